"""What the measurements mean: noise, verdicts against a baseline, trends, bisection."""
