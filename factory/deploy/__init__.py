"""Deployments: a checkpoint served as a stable OpenAI-compatible endpoint behind the gateway.

``Deployer`` boots the inference server for a checkpoint, records the version in
``deployments`` and points the gateway route ``factory/<experiment>`` at it; a new version takes
the traffic only once healthy, and the old one drains and stops. Where the servers run is a
``ServerHost`` (``factory.deploy.hosts``): detached processes on this machine, or Deployments
and Services on Kubernetes (``factory.deploy.kubernetes``); on both, by default, every version
on one base model is an adapter of one engine.
"""

from factory.deploy.deployer import (
    Checkpoint,
    DeployConfig,
    Deployer,
    Deployment,
    DeploymentError,
    check_name,
    route_model,
)
from factory.deploy.experiment import Served, deploy_experiment

__all__ = ["Checkpoint", "DeployConfig", "Deployer", "Deployment", "DeploymentError", "Served",
           "check_name", "deploy_experiment", "route_model"]
