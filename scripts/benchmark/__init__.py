"""The benchmark tool, `python -m scripts.benchmark -h`: a module per kind of scenario, sharing common and load."""
