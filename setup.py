"""Thin shim for `pip install -e .` habits; pyproject.toml is the source of truth."""
from setuptools import setup

setup()
