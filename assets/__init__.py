"""Thin ``@asset`` functions grouped by stage; collected by ``factory/definitions.py``."""
