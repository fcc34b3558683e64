"""qlab: a lab bench for low-precision training numerics.

Quantize fast with ``qlab.kernels.qdq(x, "nvfp4")`` / ``qlab.kernels.quantize``: the C, Triton or
compiled path for the tensor's device, the same bits as the plain-torch reference ``qlab.quantize``
(``quantize.qdq``, the definitions the tests hold every fast path to, several times slower).

Modules:
    paths     where data/, figures/, runs/ and notebooks/ live (the checkout you stand in; QLAB_ROOT)
    plotting  the paper style and save_figure()
    results   save_csv() and save_metrics() for notebooks
    stats     means with intervals, paired t and sign-flip tests, TOST, Holm
    numerics  variance algorithms, exact references, LayerNorm with selectable statistics
    formats   element formats (FP8/FP6/FP4/E8M0/INTn), exact casts, integer codes
    scaling   scale computation: integer affine, FP8 current/delayed, MX E8M0, NVFP4, Hadamard
    quantize  the reference: specs, quantize/dequantize/qdq in plain torch, QTensor, SQNR and clipping
    kernels   the fast entry point: kernels.qdq / kernels.quantize (C on the CPU, Triton on a GPU,
              torch.compile), bit-identical to quantize; LayerNorm kernels
    synthetic generated activations (Gaussian, Laplace, Student-t, outlier channels)
    recipe    Recipe: a spec per GEMM operand, backward_override, presets
    nn        QuantLinear, fake_quant, quantize_model / unquantize_model (a recipe or a plan)
    probes    ProbeSet, tensor statistics, GradientAudit
    sparse    top-k sparse back-propagation: mask_gradients, TopKLinear, sparsify_model
    models    packaged pretrained models, any checkpoint folder or cached hub id, your own text
    advisor   measured and approximated per-layer scores; which layers to keep in high precision
    plan      a weight format per layer under an effective-bits budget, solved exactly; the plan file
    seed_model  the seeds' quantized Linear and transformer (notebook 01)
    train     Shakespeare / digits data, CharGPT / MLP, TrainConfig, train() (checkpoints, resume, DDP)
    notebooks running parameterized notebooks with papermill (used by the CLI and the tests)
    cli       the `qlab` command: list, run, figures, sweep, findings, sync, lab, advise, train
"""

__version__ = "0.1.0"
