"""Dagster ConfigurableResources: each external system behind an interface with a local default."""
