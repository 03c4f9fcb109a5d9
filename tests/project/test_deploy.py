"""deploy/'s Kubernetes manifests parse, and name what the server really serves: the probes'
path and the scrape path are routes of the real app, the ports agree, and the container's
arguments are valid `conveyor serve` flags with one GPU per data-parallel replica (issue 17,
part 4). The manifests are not applied here."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fastapi.routing import APIRoute

from conveyor.cli import build_parser
from conveyor.entrypoints.async_llm import AsyncLLM
from conveyor.server.app import build_app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _docs() -> dict[str, dict]:
    docs = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


@pytest.fixture(scope="module")
def served_routes(demo_model_dir) -> dict[str, set[str]]:
    """Path -> methods of the real app around a real (demo) engine."""
    app = build_app(AsyncLLM(str(demo_model_dir), num_kv_blocks=16))
    return {r.path: set(r.methods) for r in app.routes if isinstance(r, APIRoute)}


def _container(docs: dict[str, dict]) -> dict:
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_parses_and_kustomization_lists_them() -> None:
    docs = _docs()
    assert set(docs) == {"Deployment", "Service", "PersistentVolumeClaim", "Kustomization"}
    listed = set(docs["Kustomization"]["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}


def test_probes_and_scrape_annotations_name_routes_the_server_serves(served_routes) -> None:
    docs = _docs()
    container = _container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert check["path"] == "/health" and "GET" in served_routes[check["path"]], probe
        assert ports[check["port"]] == 8000
    for owner in (docs["Deployment"]["spec"]["template"]["metadata"], docs["Service"]["metadata"]):
        notes = owner["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == 8000
        assert "GET" in served_routes[notes["prometheus.io/path"]]
    (service_port,) = docs["Service"]["spec"]["ports"]
    assert service_port["targetPort"] in ports
    selector = docs["Service"]["spec"]["selector"]
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_container_args_are_serve_flags_with_a_gpu_per_replica_and_the_model_volume() -> None:
    docs = _docs()
    container = _container(docs)
    args = build_parser().parse_args(["serve", *container["args"]])
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == args.data_parallel_size == 2
    assert resources["limits"]["nvidia.com/gpu"] == args.data_parallel_size
    (mount,) = container["volumeMounts"]
    assert args.model.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    (volume,) = docs["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    grace = docs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 10  # --shutdown-timeout's default: in-flight requests may finish
