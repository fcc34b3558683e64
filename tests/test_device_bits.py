"""One set of bits on every device: every qdq/quantize path on a CUDA tensor gives the CPU reference's
bits (values, codes, scales) for every preset spec, both conventions and both axes, on inputs built to
hit the cases where two implementations part: exact ties and near-ties on each grid, subnormal and
tiny amaxes, zero blocks, bf16 inputs, amaxes near the float32 maximum.

The CUDA tests skip without a GPU (they run in ``benchmarks/gpu_session.sh tests``); the division they
rely on is checked here on the CPU against float64.
"""

import dataclasses

import pytest
import torch

from qlab import quantize as Q
from qlab import scaling

CUDA = torch.cuda.is_available()
SHAPE = (128, 256)  # whole 128×128 tiles, 1×32 and 1×16 blocks along either axis


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bits, every NaN canonical (a format defines where NaN is, not its payload)."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.tensor(float("nan"), device=t.device), t).view(torch.int32)


def edge_cases() -> dict[str, torch.Tensor]:
    """float32 inputs of SHAPE, each built for one way two implementations can disagree."""
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(SHAPE, generator=g)
    cases = {
        "normal": normal,
        "outliers": normal * torch.where(torch.rand(SHAPE, generator=g) < 0.01, 1e4, 1.0),
    }
    # ties: midpoints of the E2M1 and E4M3 grids (blocks whose amax is a grid point keep scale 2^k), and
    # the float32 neighbours of those midpoints
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    e2m1_mid = (e2m1[1:] + e2m1[:-1]) / 2
    e4m3_small = torch.arange(8, 16, dtype=torch.float32) / 8  # [1, 2) on E4M3's grid (3 mantissa bits)
    e4m3_mid = e4m3_small + 1 / 16
    for name, mids, top in (("e2m1 ties", e2m1_mid, 6.0), ("e4m3 ties", e4m3_mid, 448.0)):
        pick = mids[torch.randint(len(mids), SHAPE, generator=g)]
        sign = torch.where(torch.rand(SHAPE, generator=g) < 0.5, -1.0, 1.0)
        power = 2.0 ** torch.randint(-4, 5, (SHAPE[0], 1), generator=g).float()
        tied = sign * pick * power
        tied[:, ::16] = top * power  # one grid-top element per 16 along rows
        tied[::16, :] = top * power.mean()
        cases[name] = tied
        cases[name + " +1ulp"] = torch.nextafter(tied, torch.full_like(tied, float("inf")))
        cases[name + " −1ulp"] = torch.nextafter(tied, torch.full_like(tied, -float("inf")))
    cases["subnormal amax"] = normal * 1e-40
    cases["tiny amax"] = normal * 1e-35  # where 1/global overflows float32 (torchao's NVFP4 branch)
    cases["near float32 max"] = normal / normal.abs().max() * 3.0e38
    zero_blocks = normal.clone()
    zero_blocks[:, 32:64] = 0.0
    zero_blocks[64:80, :] = 0.0
    cases["zero blocks"] = zero_blocks
    cases["all zero"] = torch.zeros(SHAPE)
    cases["bf16"] = (normal * 3).bfloat16()
    # amaxes that make amax/6, amax/2688, amax/127 inexact in float32 (odd mantissas)
    odd = (1 + torch.randint(1, 2**23, SHAPE, generator=g).float() * 2.0**-23) * 2.0 ** torch.randint(
        -20, 20, SHAPE, generator=g
    ).float()
    cases["odd mantissas"] = odd * torch.where(torch.rand(SHAPE, generator=g) < 0.5, -1.0, 1.0)
    return cases


def specs() -> dict[str, Q.QuantSpec]:
    """Every RNE preset, with torchao's convention beside NVIDIA's where a spec has both."""
    found = {}
    for name, spec in Q.SPECS.items():
        if spec.rounding != "rne":
            continue
        found[name] = spec
        if "convention" in {f.name for f in dataclasses.fields(spec)}:
            other = "torchao" if spec.convention == "nvidia" else "nvidia"
            found[f"{name}/{other}"] = dataclasses.replace(spec, convention=other)
    for mode in scaling.MX_SCALE_MODES:
        found[f"mxfp4/{mode}"] = Q.MXSpec("e2m1", mode=mode)
        found[f"mxfp8/{mode}"] = Q.MXSpec("e4m3", mode=mode)
    return found


CASES = edge_cases()
SPECS = specs()
# compiling costs seconds per (spec, axis, dtype): the compiled path is checked on one spec of each
# class, element kind, convention and block shape
COMPILED = {
    "fp8_e4m3", "fp8_e4m3/torchao", "fp8_e4m3_rowwise", "fp8_blockwise", "fp8_blockwise_2d", "int8",
    "int8_rowwise", "uint8_asymmetric", "mxfp8", "mxfp8_rceil", "mxfp8_2d", "mxfp4", "nvfp4",
    "nvfp4/torchao", "nvfp4_2d", "nvfp4_rht",
}  # fmt: skip


def test_divide_by_is_the_correctly_rounded_quotient():
    # a float32 quotient rounded from float64 is correctly rounded (53 ≥ 2·24 + 2 bits)
    g = torch.Generator().manual_seed(1)
    x = (1 + torch.rand(1 << 16, generator=g)) * 2.0 ** torch.randint(
        -60, 60, (1 << 16,), generator=g
    ).float()
    for divisor in (6.0, 2688.0, 127.0, 255.0, 7.0):
        expected = (x.double() / divisor).float()
        assert torch.equal(_bits(scaling.divide_by(x, divisor)), _bits(expected)), divisor


def test_the_division_op_used_off_the_cpu_divides_exactly_eagerly_and_compiled():
    """Off the CPU divide_by calls qlab::divide_by, which inductor cannot turn into a multiplication by
    the reciprocal; the op itself is checked here on the CPU, eagerly and inside torch.compile."""
    x = torch.rand(4096, generator=torch.Generator().manual_seed(2)) * 1e3
    expected = _bits((x.double() / 2688.0).float())
    compiled = torch.compile(lambda t: scaling._divide_op(t, 2688.0), fullgraph=True)
    assert torch.equal(_bits(scaling._divide_op(x, 2688.0)), expected)
    assert torch.equal(_bits(compiled(x)), expected)


def test_the_torchao_nvfp4_scaling_op_gives_the_eager_bits_eagerly_and_compiled():
    """Off the CPU torchao's NVFP4 element scaling runs as qlab::nvfp4_scaled_torchao (opaque to
    inductor); the op is checked here on the CPU against the eager formula, eagerly and compiled, with
    elements at exact E2M1 ties and an overflowing inverse (a tiny global scale)."""
    from qlab.quantize import _nvfp4_scaled_torchao_eager, _nvfp4_scaled_torchao_op

    ties = CASES["e2m1 ties"].reshape(128, 16, 16)
    blocks = ties.abs().amax(-1, keepdim=True) / 6
    compiled = torch.compile(lambda *args: _nvfp4_scaled_torchao_op(*args), fullgraph=True)
    for global_scale in (torch.tensor(0.75), torch.tensor(1e-38)):
        expected = _bits(_nvfp4_scaled_torchao_eager(ties, global_scale, blocks))
        assert torch.equal(_bits(_nvfp4_scaled_torchao_op(ties, global_scale, blocks)), expected)
        assert torch.equal(_bits(compiled(ties, global_scale, blocks)), expected)


def test_the_compiled_subset_names_checked_specs():
    assert COMPILED <= set(SPECS), COMPILED - set(SPECS)


def test_edge_cases_hit_ties_and_inexact_divisions():
    """The datasets do what they are for: some elements lie exactly halfway between two E2M1 values,
    and some amax / 2688 quotients are inexact in float32."""
    ties = CASES["e2m1 ties"].abs()
    scaled = ties / 2.0 ** torch.floor(torch.log2(ties.amax(dim=1, keepdim=True) / 6))
    assert torch.isin(scaled, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).any()
    odd = CASES["odd mantissas"].abs().amax(dim=1).double()
    assert ((odd / 2688).float().double() != odd / 2688).any()


def _paths(x: torch.Tensor, spec_name: str, axis: int) -> dict[str, torch.Tensor]:
    from qlab import kernels

    spec = SPECS[spec_name]
    results = {"eager": Q.qdq(x, spec, axis)}
    if spec_name in COMPILED and x.dtype == torch.float32:
        results["compiled"] = kernels.qdq(x, spec, axis, backend="cpu")
    if kernels.covers(spec):
        results["triton"] = kernels.qdq(x, spec, axis)
    return results


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in benchmarks/gpu_session.sh tests)")
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_every_cuda_path_gives_the_cpu_bits(spec_name):
    spec, differences = SPECS[spec_name], []
    for case, x in CASES.items():
        for axis in (-1, 0):
            expected = _bits(Q.qdq(x, spec, axis))
            for path, got in _paths(x.cuda(), spec_name, axis).items():
                wrong = int((_bits(got.cpu()) != expected).sum())
                if wrong:
                    differences.append(f"{path}, {case}, axis {axis}: {wrong} values")
            if spec.tile_rows == 1 or axis == -1:
                cpu, gpu = Q.quantize(x, spec, axis), Q.quantize(x.cuda(), spec, axis)
                if not torch.equal(cpu.codes, gpu.codes.cpu()):
                    differences.append(f"quantize codes, {case}, axis {axis}")
                for part in ("scales", "global_scale", "zero_point"):
                    a, b = getattr(cpu, part), getattr(gpu, part)
                    if a is not None and not torch.equal(_bits(a), _bits(b.cpu())):
                        differences.append(f"quantize {part}, {case}, axis {axis}")
    assert not differences, f"{spec_name}: " + "; ".join(differences)


DELAYED = ("fp8_e4m3", "fp8_e4m3/torchao", "fp8_e5m2", "fp8_e5m2/torchao")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in benchmarks/gpu_session.sh tests)")
@pytest.mark.parametrize("spec_name", DELAYED)
def test_delayed_scaling_on_cuda_runs_the_kernel_with_the_cpu_bits(monkeypatch, spec_name):
    """A fixed per-tensor scale (delayed scaling) on a CUDA tensor runs the FP8 kernel: kernels.qdq (in
    x's dtype and in bfloat16), kernels.quantize and kernels.fp8_with_scale give the CPU reference's
    values and codes, for scales that fit (current scaling's, float32's max for a subnormal amax),
    flush to zero and saturate (overflowing float32 too)."""
    from qlab import kernels
    from qlab.kernels import fp8_triton

    launches = []
    kernel = fp8_triton.fp8_fixed_scale
    monkeypatch.setattr(fp8_triton, "fp8_fixed_scale", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    spec, differences = SPECS[spec_name], []
    for case, x in CASES.items():
        fitted = scaling.fp8_current_scale(x.float().abs().max(), spec.element)  # finite: float32 max at most
        for scale in (torch.tensor(0.37), torch.tensor(2.0**-20), torch.tensor(2.0**20), fitted):
            held = scale.float().reshape(()).cuda()
            for axis in (-1, 0):
                for dtype in (None, torch.bfloat16):
                    expected = _bits(Q.qdq(x, spec, axis, scale=scale, dtype=dtype))
                    paths = {
                        "qdq": kernels.qdq(x.cuda(), spec, axis, scale=held, dtype=dtype),
                        "fp8_with_scale": kernels.fp8_with_scale(
                            x.cuda(), spec, axis, held, codes=False, dtype=dtype
                        ),
                    }
                    for path, got in paths.items():
                        wrong = int((_bits(got.cpu()) != expected).sum())
                        if wrong:
                            differences.append(
                                f"{path}, {case}, scale {scale.item()}, {dtype}: {wrong} values"
                            )
                ref = Q.quantize(x, spec, axis, scale=scale)
                quantized = {
                    "quantize": kernels.quantize(x.cuda(), spec, axis, scale=held),
                    "fp8_with_scale codes": kernels.fp8_with_scale(x.cuda(), spec, axis, held, codes=True),
                }
                for path, q in quantized.items():
                    if not torch.equal(q.codes.cpu(), ref.codes):
                        differences.append(f"{path}, {case}, scale {scale.item()}, axis {axis}")
    assert not differences, f"{spec_name}: " + "; ".join(differences)
    assert len(launches) == len(CASES) * 4 * 2 * 6
