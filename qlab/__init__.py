"""qlab: a lab bench for low-precision training numerics.

Quantize fast with ``qlab.kernels.qdq(x, "nvfp4")`` / ``qlab.kernels.quantize``: the C, Triton or
compiled path for the tensor's device, the same bits as the plain-torch reference ``qlab.quantize``
(``quantize.qdq``, the definitions the tests hold every fast path to, several times slower).

Modules, by layer (each imports only its own layer and those below; docs/architecture.md):
    paths     where data/, figures/, runs/ and notebooks/ live (the checkout you stand in; QLAB_ROOT)
    checks    the argument checks every public entry point shares
    host      the device a name resolves to, a one-line name for the machine
    plotting  the paper style and save_figure()
    results   save_csv() and save_metrics() for notebooks
    stats     means with intervals, paired t and sign-flip tests, TOST, Holm
    numerics  variance algorithms, exact references, LayerNorm with selectable statistics
    formats   element formats (FP8/FP6/FP4/E8M0/INTn), exact casts, integer codes
    scaling   scale computation: integer affine, FP8 current/delayed, MX E8M0, NVFP4, Hadamard
    quantize  the reference: specs, quantize/dequantize/qdq in plain torch, QTensor, SQNR and clipping
    ops       qlab's torch operators (the C qdq kernel, stochastic rounding's draws, the bias gradient)
    kernels   the fast entry point: kernels.qdq / kernels.quantize (C on the CPU, Triton on a GPU,
              torch.compile), bit-identical to quantize; LayerNorm kernels
    compat    names that moved, still reachable with a DeprecationWarning
    synthetic generated activations (Gaussian, Laplace, Student-t, outlier channels)
    recipe    Recipe: a spec per GEMM operand, backward_override, presets
    nn        QuantLinear, fake_quant, quantize_model / unquantize_model (a recipe or a plan)
    probes    ProbeSet, tensor statistics, GradientAudit
    sparse    top-k sparse back-propagation: mask_gradients, TopKLinear, sparsify_model
    ablation  recipe variants with one ingredient switched off (notebook 07)
    models    packaged pretrained models, any checkpoint folder or cached hub id, your own text
    advisor   measured and approximated per-layer scores; which layers to keep in high precision
    plan      a weight format per layer under an effective-bits budget, solved exactly; the plan file
    seed_model  the seed's quantized Linear and transformer (notebook 01)
    train     Shakespeare / digits data, CharGPT / MLP, TrainConfig, train() (checkpoints, resume, DDP)
    session   what a notebook calls first: where its results go, its device, its progress bars
    claims    findings as data: claims with their tests, rendered into the notebooks' text
    runs      many independent runs at once: worker processes, packed GPUs or a Ray cluster
    run_lists the training runs of notebooks 03 and 07 as functions of their parameters
    campaign  a run list finished across many invocations, each run stored as plain files
    crossmachine  how far a change of machine moves a run, and which findings survive it
    notebooks running parameterized notebooks with papermill (used by the CLI and the tests)
    sweep     a notebook over the cartesian product of a YAML grid
    lab       JupyterLab on the checkout, saving clean notebooks and executed copies
    cli       the qlab command: list, run, figures, sweep, campaign, findings, sync, lab, advise,
              report, train
"""

__version__ = "0.1.0"
