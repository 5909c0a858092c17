"""Serving engine: torch-free scheduling of many streams, and the loop that runs the model."""
