"""The paper's findings in miniature: experiment drivers that train and read runs (minutes to hours;
never run by pytest, which tests the statistics in miniature.py in tests/test_miniature_stats.py):

    miniature.py       continual post-training on the toy suite, every arm on paired seeds, with statistics
    sort_fade.py       why SDPO's early gain on toy/sort fades (one arm per suspect)
    teacher_track.py   the teacher's own accuracy over a continual run
    spectral_runs.py   spectral parameter drift of finished miniature runs
    teacher_signal.py  does the self-teacher signal exist on the toy base (a demonstration in context)?
    grpo_vs_sdpo.py    GRPO vs SDPO on one toy domain, side by side
    compare_runs.py    are two runs of one (arm, seed) numerically identical (a rerun reproduces a run)?

Run them as scripts, from any folder: `python tests/experiments/<name>.py` (usage in each docstring).
They import each other as `from tests.experiments import miniature`: tests/ has no __init__.py (pytest
imports conftest.py as a top-level module), so with the repo root on sys.path (each script's one
insert) `tests` is a namespace package and this folder a package in it.
"""
