"""Curation: an experiment's samples made into clean, decontaminated train/eval datasets.

``pipeline.curate`` is the embedded engine (in process, Arrow/numpy); ``spark.curate_spark``
the same logic on Spark. Both run ``features.sample_features`` per row and ``decide.decide``
for the split and the cleaning steps; ``store`` reads and writes the lake.
"""
