"""qlab: a lab bench for low-precision training numerics.

Modules:
    paths     where data/, figures/, runs/ and notebooks/ live (independent of the working directory)
    plotting  the paper style and save_figure()
    results   save_csv() and save_metrics() for notebooks
    numerics  variance algorithms, exact references, LayerNorm with selectable statistics
    formats   element formats (FP8/FP6/FP4/E8M0/INTn), exact casts, integer codes
    scaling   scale computation: integer affine, FP8 current/delayed, MX E8M0, NVFP4, Hadamard
    quantize  specs, quantize/dequantize/qdq, QTensor, SQNR and clipping measurements
    synthetic generated activations (Gaussian, Laplace, Student-t, outlier channels)
    recipe    Recipe: a spec per GEMM operand, backward_override, presets
    nn        QuantLinear, fake_quant, quantize_model / unquantize_model
    probes    ProbeSet, tensor statistics, GradientAudit
    sparse    top-k sparse back-propagation: mask_gradients, TopKLinear, sparsify_model
    kernels   Triton kernels (MX, FP8, NVFP4 qdq; LayerNorm) behind one dispatch point per operation
    seed_model  the seeds' quantized Linear and transformer (notebook 01)
    train     Shakespeare / digits data, CharGPT / MLP, TrainConfig, train() (checkpoints, resume, DDP)
    notebooks running parameterized notebooks with papermill (used by the CLI and the tests)
    cli       the `qlab` command: list, run, figures, sweep, sync, train
"""

__version__ = "0.1.0"
