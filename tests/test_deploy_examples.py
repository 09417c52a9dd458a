"""The deployment examples under deploy/ and configs/ stay valid: Ray Serve's own schema for the
`serve deploy` file, our Config for every config they carry. (Nothing here deploys: see
NOTES-scale.md for what ran where.)"""
from __future__ import annotations

import importlib
from pathlib import Path

import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from async_cosyvoice.config import Config
from ray_app.deployments import CosyVoiceIngress, CosyVoiceModel

REPO = Path(__file__).resolve().parents[1]


def _import(path: str):
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_ray_serve_deploy_config_is_valid_and_points_at_our_code():
    schema = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "deploy/ray-serve.yaml").read_text()))
    for fn in schema.grpc_options.grpc_servicer_functions:
        assert callable(_import(fn))
    (app,) = schema.applications
    build = _import(app.import_path)
    assert isinstance(build({"config": str(REPO / app.args["config"])}), Application)
    assert {d.name for d in app.deployments} == {CosyVoiceModel.name, CosyVoiceIngress.name}


def test_example_configs_validate():
    for path in ["configs/ray.yaml", "configs/multi-gpu.yaml"]:
        Config.load(REPO / path, env={})
    docs = list(yaml.safe_load_all((REPO / "deploy/k8s/cosyvoice.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service", "StatefulSet", "Service"]
    config = Config.model_validate(yaml.safe_load(docs[0]["data"]["config.yaml"]))
    assert config.speakers.backend == "redis"
