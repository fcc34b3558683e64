"""qlab: a lab bench for low-precision training numerics.

Modules:
    paths     where data/, figures/, runs/ and notebooks/ live (independent of the working directory)
    plotting  the paper style and save_figure()
    results   save_csv() and save_metrics() for notebooks
    numerics  variance algorithms, exact references, LayerNorm with selectable statistics
    notebooks running parameterized notebooks with papermill (used by the CLI and the tests)
    cli       the `qlab` command: run, figures, sweep, sync
"""

__version__ = "0.1.0"
