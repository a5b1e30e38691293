"""The benchmark tool: `python -m scripts.benchmark <scenario> [options]`, run from the repository root.
Scenarios: experiment and floor (experiment.py), peers and model-processes (layouts.py), variable-length,
profile, gpu; each but gpu writes one results page. `common` and `load` are what they share."""
