"""icrl_core: the pure library (model, value head, losses, kernels, episodes, config).

It never imports prefect, ray, mlflow or dvc: stages adapt it in `tasks/`, flows orchestrate in `flows/`.
"""

__version__ = "0.1.0"
