"""minirl: distributed RL for language models, built up notebook by notebook.

Most modules here are generated from the notebooks in `notebooks/` by `tools/build.py`
(their first line says so): edit the notebook, then rebuild. The hand-written modules are
listed in `HAND_WRITTEN` in `tools/build.py`.

Nothing is imported eagerly, so `import minirl` is instant; import the module you need,
for example `from minirl.tasks import make_task`.
"""

__version__ = "0.1.0"
