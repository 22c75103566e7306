"""Hand the planned engine over to a cluster: a values file for vLLM production-stack's Helm chart.

``teamserve_production_stack_values`` turns what the vllm role's ``plan`` entry point publishes (the engine's
argv, the pinned image, the capacity plan, the model profile) into the values of production-stack's
``vllm-stack`` chart, so the cluster engine starts with the same planned flags as the box.
``teamserve_production_stack_check`` checks a values dict against the chart's keys as described below,
and ``teamserve_production_stack_header`` writes the comment block playbooks/handover.yml puts on top.

Source of the mapping: github.com/vllm-project/production-stack, chart ``vllm-stack`` **0.1.12**, read at
commit a6c01db05f65f556235413ba8dbcfb0c01132fff (2026-08-05, the newest stored), files ``helm/Chart.yaml``
(the version), ``helm/values.yaml`` and ``helm/values.schema.json`` (the keys and their types) and
``helm/templates/deployment-vllm-multi.yaml`` (how each key becomes the engine's command line). The
version was set to 0.1.12 at 66b60661aa3052810859a417559e9e830772a091; between that commit and a6c01db the
keys written here and the template lines that read them are unchanged (the one change to the engine
template, ``pvcExistingClaimName``, touches a key this module does not write).

What the chart does with the keys (deployment-vllm-multi.yaml):
  - the container's image is ``"<repository>:<tag>"``, nothing else reads ``tag``; so ``tag`` carries
    ``<tag>@<digest>`` and Kubernetes pulls the pinned digest (the tag is then informational);
  - the command is ``vllm serve <modelURL> --host 0.0.0.0 --port <servingEngineSpec.containerPort>``, then
    ``--enable-lora`` (``enableLoRA``), the ``vllmConfig`` flags, ``vllmConfig.extraArgs`` one element per
    argv token, ``--revision`` (``modelRevision``) and ``--chat-template /templates/<chatTemplate>``;
  - ``vllmConfig`` present always yields ``--enable-prefix-caching`` or ``--no-enable-prefix-caching``
    (false when the key is absent), the other ``vllmConfig`` flags only when their key is set;
  - ``servingEngineSpec.vllmApiKey`` as ``{secretName, secretKey}`` sets ``VLLM_API_KEY`` in the engine and
    the router from an existing Secret (a plain string would be written into a Secret the chart makes,
    i.e. the key would have to be in the values file: refused here).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

try:  # The pure functions below are unit-tested without Ansible's error type.
    from ansible.errors import AnsibleFilterError
except ImportError:  # pragma: no cover
    AnsibleFilterError = ValueError

CHART_NAME = "vllm-stack"
CHART_VERSION = "0.1.12"
CHART_REPO_URL = "https://vllm-project.github.io/production-stack"
CHART_SOURCE = "https://github.com/vllm-project/production-stack/tree/a6c01db05f65f556235413ba8dbcfb0c01132fff/helm"
CHART_COMMIT = "a6c01db05f65f556235413ba8dbcfb0c01132fff"

# --- The chart's keys this module knows (own description, from values.schema.json and the templates) ---------
# A description is a type name ("string", "integer" (not a bool), "number" (int or float), "boolean",
# "object" (any mapping, passed through to Kubernetes), "array" (any list), "labels" (mapping of string to
# string: Kubernetes labels/annotations)), a tuple of descriptions (any of them), a frozenset (one of these
# strings), a dict (a mapping with only these keys) or a one-element list (an array of that).
_SECRET_REF = {"secretName": "string", "secretKey": "string"}

VLLM_CONFIG_KEYS: dict[str, Any] = {
    "v0": "string",
    "enablePrefixCaching": "boolean",
    "enableChunkedPrefill": "boolean",
    "maxModelLen": "integer",
    "dtype": "string",
    "tensorParallelSize": "integer",
    "maxNumSeqs": "integer",
    "maxLoras": "integer",
    "gpuMemoryUtilization": ("integer", "number", "string"),
    "runner": frozenset({"auto", "pooling"}),
    "convert": frozenset({"token_embed", "embed", "token_classify", "classify", "score"}),
    "extraArgs": ["string"],
    "prometheusMultiprocDir": "string",  # read by the template (PROMETHEUS_MULTIPROC_DIR); not in the schema
}

MODEL_SPEC_KEYS: dict[str, Any] = {
    "name": "string",
    "enabled": "boolean",
    "annotations": "labels",
    "podAnnotations": "labels",
    "labels": "labels",
    "podLabels": "labels",
    "serviceAccountName": "string",
    "priorityClassName": "string",
    "runtimeClassName": "string",
    "repository": "string",
    "tag": "string",
    "imagePullSecret": "string",
    "modelURL": "string",
    "modelRevision": "string",
    "replicaCount": "integer",
    "resources": "object",
    "requestCPU": "integer",
    "requestMemory": "string",
    "requestGPU": ("integer", "number", "string"),
    "requestGPUType": "string",
    "limitCPU": ("integer", "number", "string"),
    "limitMemory": "string",
    "pvcStorage": "string",
    "pvcAccessMode": ["string"],
    "storageClass": "string",
    "pvcMatchLabels": "labels",
    "pvcLabels": "labels",
    "pvcAnnotations": "labels",
    "extraVolumes": "array",
    "extraVolumeMounts": "array",
    "initContainer": "object",
    "vllmConfig": VLLM_CONFIG_KEYS,
    "lmcacheConfig": "object",
    "hf_token": _SECRET_REF,  # the schema also takes the token itself as a string: refused, as vllmApiKey
    "envFromSecret": {"name": "string"},
    "env": [{"name": "string", "value": "string"}],
    "affinity": "object",
    "nodeSelectorTerms": "array",
    "nodeName": "string",
    "tolerations": "array",
    "tolerationsPolicy": frozenset({"append", "override"}),
    "shmSize": "string",
    "serviceAnnotations": "labels",
    "enableLoRA": "boolean",
    "keda": "object",
    "raySpec": "object",
    # Read by the template, not in the schema.
    "chatTemplate": "string",
    "chatTemplateConfigMap": "string",
    "enableTool": "boolean",
    "toolCallParser": "string",
    "pvcExistingClaimName": "string",
}

# The top level: only what this module writes. Other settings (routerSpec, ...) belong in the operator's own
# values file, given to helm after this one (`-f handover.yaml -f ours.yaml`).
VALUES_KEYS: dict[str, Any] = {
    "servingEngineSpec": {
        "vllmApiKey": _SECRET_REF,
        "modelSpec": [MODEL_SPEC_KEYS],
    },
}

# --- How the planned argv maps onto the chart ---------------------------------------------------------------
# Aliases vLLM's parser accepts for the flags mapped below (vllm-serve-options-0.32.0.json); underscores
# are read as dashes by vLLM's parser too.
_ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size",
            "--device-memory-utilization": "--gpu-memory-utilization"}
# Value flags -> vllmConfig key and the value's type.
_VALUE_KEYS: dict[str, tuple[str, str]] = {
    "--max-model-len": ("maxModelLen", "integer"),
    "--max-num-seqs": ("maxNumSeqs", "integer"),
    "--gpu-memory-utilization": ("gpuMemoryUtilization", "number"),
    "--tensor-parallel-size": ("tensorParallelSize", "integer"),
    "--dtype": ("dtype", "string"),
    "--max-loras": ("maxLoras", "integer"),
    "--runner": ("runner", "enum"),
    "--convert": ("convert", "enum"),
}
# Switches -> vllmConfig key (the --no- form sets false).
_SWITCH_KEYS = {"--enable-prefix-caching": "enablePrefixCaching", "--enable-chunked-prefill": "enableChunkedPrefill"}
# Flags the chart writes itself from its own settings: dropped from the argv.
_CHART_SETS = {"--host": "the chart listens on 0.0.0.0 in the pod",
               "--port": "the chart sets it from servingEngineSpec.containerPort (8000, as on the box)"}
# The engine's key: never written; the chart reads it from a Secret (servingEngineSpec.vllmApiKey).
# `--config` is the vllm role's engine config file, which holds the key and nothing else.
_KEY_FLAGS = ("--api-key", "--config")
# What the chart's Deployment cannot run: the reason, naming what to change.
_REFUSED = {
    **dict.fromkeys(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-ciphers",
                     "--enable-ssl-refresh"),
                    "the chart's probes and router reach the engine over plain HTTP; terminate TLS at the ingress "
                    "or gateway in front of the router instead"),
    "--uds": "the chart's probes, Service and router reach the engine over TCP on containerPort",
    **dict.fromkeys(("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
                     "--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-start-rank",
                     "--data-parallel-rank", "--data-parallel-external-lb", "--data-parallel-hybrid-lb",
                     "--data-parallel-multi-port-external-lb"),
                    "the chart's Deployment runs each replica as one pod; an engine across nodes needs the chart's "
                    "raySpec (or llm-d / Ray Serve, docs/handover.md), which this handover does not write"),
}
_OPTIONS = {"replica_count", "release_name", "name", "api_key_secret", "hf_token_secret", "request_cpu",
            "request_memory", "pvc_storage", "chat_template", "env"}
_SECRETISH = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIALS?)($|_)", re.IGNORECASE)
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
# "<release>-<name>-engine-service" (the Service) and "<release>-<name>-chat-templates" (a volume) must be
# DNS labels of at most 63 characters: release name and model name together at most 63 - 16.
_NAME_BUDGET = 47


def _is_flag(token: str) -> bool:
    """True for an option token (``--x``, ``-tp``), False for a value (a negative number is a value)."""
    return token.startswith("-") and not re.match(r"^-\d", token)


def _canonical(flag: str) -> str:
    """``--max_model_len`` -> ``--max-model-len``; ``-tp`` -> ``--tensor-parallel-size``."""
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
    return _ALIASES.get(flag, flag)


def _groups(tokens: Sequence[str]) -> list[dict[str, Any]]:
    """Split argv tokens (after the model) into one group per flag: the canonical flag, its values and the
    tokens exactly as written. Raises AnsibleFilterError for a value that follows no flag."""
    groups: list[dict[str, Any]] = []
    for position, token in enumerate(tokens, start=1):
        if _is_flag(token):
            flag, has_value, value = token.partition("=")
            groups.append({"flag": _canonical(flag), "written": flag, "values": [value] if has_value else [],
                           "tokens": [token]})
        elif groups:
            groups[-1]["values"].append(token)
            groups[-1]["tokens"].append(token)
        else:
            raise AnsibleFilterError(f"vllm_argv[{position}]: {token!r} follows no flag; expected the argv the vllm "
                                     "role renders ([MODEL, --flag, value, ...])")
    return groups


def _one_value(group: Mapping[str, Any]) -> str:
    if len(group["values"]) != 1:
        raise AnsibleFilterError(f"vllm_argv: '{group['written']}' has {len(group['values'])} values; the chart's "
                                 "key for it takes exactly one")
    return str(group["values"][0])


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise AnsibleFilterError(f"{what}: {value!r} is not an integer")
    try:
        return int(str(value).strip())
    except ValueError:
        raise AnsibleFilterError(f"{what}: {value!r} is not an integer") from None


def _secret_ref(value: Any, what: str, default: Mapping[str, str] | None) -> dict[str, str] | None:
    """``{secretName, secretKey}`` from an option (a mapping with both non-empty), the default when unset."""
    if value is None:
        return dict(default) if default else None
    if not isinstance(value, Mapping) or set(value) != {"secretName", "secretKey"} \
            or not all(isinstance(v, str) and v for v in value.values()):
        raise AnsibleFilterError(f"options.{what}: expected {{secretName: <Secret name>, secretKey: <key in it>}}, "
                                 f"a reference to an existing Kubernetes Secret (never the secret itself); got "
                                 f"{sorted(value) if isinstance(value, Mapping) else type(value).__name__}")
    return {"secretName": str(value["secretName"]), "secretKey": str(value["secretKey"])}


def _dns_name(served: str, budget: int) -> str:
    """A DNS-1123 label from a served model name: lower case, runs of other characters as one '-', at most
    ``budget`` characters. Raises AnsibleFilterError when nothing is left."""
    name = re.sub(r"[^a-z0-9]+", "-", served.lower()).strip("-")[:budget].rstrip("-")
    if not name:
        raise AnsibleFilterError(f"served_model_name {served!r} has no letter or digit to name the chart's "
                                 "modelSpec with; set options.name")
    return name


def teamserve_production_stack_values(argv: Any, image_parts: Any, plan: Any, model: Any,
                                      options: Any = None) -> dict[str, Any]:
    """The values file (as a dict) that runs the planned engine with production-stack's chart 0.1.12.

    Inputs:
      argv: ``vllm_argv``, the vllm role's engine argv ``[MODEL, --flag, value, ...]`` (strings).
      image_parts: ``vllm_image_parts``, ``{repository, tag, digest}`` of the pinned engine image.
      plan: ``vllm_plan`` (the capacity planner's result); ``flags["tensor-parallel-size"]`` when the argv has
        none, ``numbers`` (gpu, gpu_count, gpu_total_gib in GiB, kv_tokens in tokens) for the annotations.
      model: ``vllm_model`` (``name``: the model when the argv starts with a flag; ``served_model_name``: the name).
      options (all optional): ``replica_count`` (pods, default 1); ``release_name`` (the Helm release the file
        is meant for, default ``vllm``: it bounds the length of ``name``); ``name`` (the modelSpec name, a
        DNS-1123 label; default derived from served_model_name); ``api_key_secret`` (``{secretName,
        secretKey}`` of the Secret holding the engine's key, default ``teamserve-vllm-api-key`` / ``api-key``);
        ``hf_token_secret`` (same shape, for a gated model; default none); ``request_cpu`` (CPU cores, default
        6) and ``request_memory`` (Kubernetes quantity, default ``16Gi``) - the chart requires both and they
        are the chart's own example values, teamserve does not plan them; ``pvc_storage`` (Kubernetes
        quantity for the weights' volume; default none: the pod downloads them on every start);
        ``chat_template`` (the text of the template file the box mounts with ``--chat-template``); ``env``
        (mapping of engine environment variables, e.g. vllm_env).
    Output: ``{"servingEngineSpec": {"vllmApiKey": {...}, "modelSpec": [{...}]}}`` with ``name``,
    ``repository``, ``tag`` (``<tag>@<digest>``), ``modelURL``, ``modelRevision``, ``replicaCount``,
    ``requestCPU``, ``requestMemory``, ``requestGPU`` (GPUs per replica: tensor x pipeline x data parallel
    sizes), ``enableLoRA``, ``vllmConfig`` (maxModelLen and maxNumSeqs in tokens and sequences,
    gpuMemoryUtilization as a fraction, tensorParallelSize, enablePrefixCaching, enableChunkedPrefill, dtype,
    maxLoras, runner/convert when the chart's enum has the value; ``extraArgs``: every other planned flag,
    token for token as in the argv, in the argv's order), ``annotations`` (the pinned digest, the model
    revision and the GPU the plan was made for), and ``env``, ``hf_token``, ``pvcStorage``,
    ``chatTemplate``/``chatTemplateConfigMap`` (the text adjusted by ``chart_chat_template``) when given. Checked with ``teamserve_production_stack_check``.
    Dropped from the argv on purpose: ``--host`` and ``--port`` (the chart's own), ``--api-key`` and
    ``--config`` (the key; replaced by the Secret reference, the key itself is never in the output).
    Raises AnsibleFilterError naming the flag or option for: a flag the chart cannot run (TLS on the engine,
    a Unix socket, an engine across nodes: ``_REFUSED``), ``--chat-template`` without its text, an argv with
    neither ``--enable-prefix-caching`` nor its ``--no-`` form (the chart always passes one), a mapped flag
    given twice or with other than one value, an image without a digest, a secret-looking ``env`` name, an
    unknown option, a name that is not a DNS-1123 label or too long for the release name.
    """
    opts = dict(options or {})
    unknown = sorted(set(opts) - _OPTIONS)
    if unknown:
        raise AnsibleFilterError(f"options: {unknown} are not options of teamserve_production_stack_values; "
                                 f"known: {sorted(_OPTIONS)}")
    if not isinstance(argv, Sequence) or isinstance(argv, str) or not argv:
        raise AnsibleFilterError("vllm_argv must be the non-empty list [MODEL, --flag, value, ...]")
    tokens = [str(t) for t in argv]
    model = model if isinstance(model, Mapping) else {}
    plan = plan if isinstance(plan, Mapping) else {}
    parts = image_parts if isinstance(image_parts, Mapping) else {}
    for key in ("repository", "tag", "digest"):
        if not parts.get(key):
            raise AnsibleFilterError(f"vllm_image_parts.{key} is empty; the handover pins the image by tag and digest "
                                     "(vllm_image = REPOSITORY:TAG@sha256:...)")

    model_url = tokens[0] if not _is_flag(tokens[0]) else str(model.get("name") or "")
    rest = tokens[1:] if not _is_flag(tokens[0]) else tokens
    if not model_url:
        raise AnsibleFilterError("vllm_argv has no model (its first element) and vllm_model.name is empty")

    vllm_config: dict[str, Any] = {}
    extra: list[str] = []
    spec: dict[str, Any] = {}
    key_flag_seen = False
    chat_template_seen = False
    parallel = {"--tensor-parallel-size": 0, "--pipeline-parallel-size": 1, "--data-parallel-size": 1}
    seen: dict[str, str] = {}

    def once(flag: str, written: str) -> None:
        if flag in seen:
            raise AnsibleFilterError(f"vllm_argv: '{written}' repeats '{seen[flag]}'; the chart sets it once "
                                     "(vLLM would keep the last one) - remove one")
        seen[flag] = written

    for group in _groups(rest):
        flag, written = group["flag"], group["written"]
        positive = "--" + flag[len("--no-"):] if flag.startswith("--no-") else flag
        if positive in _REFUSED and not flag.startswith("--no-"):
            raise AnsibleFilterError(f"vllm_argv: '{written}' cannot be expressed in production-stack's chart "
                                     f"{CHART_VERSION}: {_REFUSED[positive]}")
        if flag in _KEY_FLAGS:
            key_flag_seen = True  # values not read, never repeated anywhere
            continue
        if flag in _CHART_SETS:
            continue
        if flag in _VALUE_KEYS:
            once(flag, written)
            key, kind = _VALUE_KEYS[flag]
            value = _one_value(group)
            if flag == "--tensor-parallel-size":
                parallel[flag] = _int(value, f"vllm_argv: '{written}'")
            if kind == "integer":
                if re.fullmatch(r"\d+", value.strip()):
                    vllm_config[key] = int(value)
                else:  # e.g. --max-model-len 32k, which vLLM reads and the chart's integer key cannot hold
                    extra.extend(group["tokens"])
            elif kind == "number":
                try:
                    vllm_config[key] = float(value)
                except ValueError:
                    vllm_config[key] = value
            elif kind == "enum":
                if value in VLLM_CONFIG_KEYS[key]:
                    vllm_config[key] = value
                else:  # a value vLLM knows and the chart's enum does not: passed through as written
                    extra.extend(group["tokens"])
            else:
                vllm_config[key] = value
            continue
        if positive in _SWITCH_KEYS:
            once(positive, written)
            if group["values"]:
                raise AnsibleFilterError(f"vllm_argv: '{written}' is a switch and takes no value")
            vllm_config[_SWITCH_KEYS[positive]] = not flag.startswith("--no-")
            continue
        if positive == "--enable-lora":
            once(positive, written)
            spec["enableLoRA"] = not flag.startswith("--no-")
            continue
        if flag == "--revision":
            once(flag, written)
            spec["modelRevision"] = _one_value(group)
            continue
        if flag == "--chat-template":
            once(flag, written)
            chat_template_seen = True
            continue
        if flag in ("--pipeline-parallel-size", "--data-parallel-size"):
            once(flag, written)
            parallel[flag] = _int(_one_value(group), f"vllm_argv: '{written}'")
        extra.extend(group["tokens"])

    if "enablePrefixCaching" not in vllm_config:
        raise AnsibleFilterError(
            "vllm_argv has neither --enable-prefix-caching nor --no-enable-prefix-caching, and production-stack's "
            f"chart {CHART_VERSION} always passes one of them (false when unset); set vllm_flags "
            "enable-prefix-caching to say which, so the cluster engine matches the box")
    if not parallel["--tensor-parallel-size"]:
        flags = plan.get("flags") if isinstance(plan.get("flags"), Mapping) else {}
        parallel["--tensor-parallel-size"] = _int(flags.get("tensor-parallel-size") or 1,
                                                  "vllm_plan.flags.tensor-parallel-size")
    vllm_config["tensorParallelSize"] = parallel["--tensor-parallel-size"]
    if any(n < 1 for n in parallel.values()):
        raise AnsibleFilterError(f"vllm_argv: parallel sizes must be at least 1; got {parallel}")
    vllm_config["extraArgs"] = extra

    release = str(opts.get("release_name") or "vllm")
    if not _DNS_LABEL.match(release) or len(release) > 53:
        raise AnsibleFilterError(f"options.release_name: {release!r} is not a Helm release name (a DNS-1123 label of "
                                 "at most 53 characters)")
    budget = _NAME_BUDGET - len(release)
    served = str(model.get("served_model_name") or model_url.rstrip("/").rsplit("/", 1)[-1])
    if opts.get("name"):
        name = str(opts["name"])
        if not _DNS_LABEL.match(name) or len(name) > budget:
            raise AnsibleFilterError(
                f"options.name: {name!r} must be a DNS-1123 label (lower-case letters, digits, '-') of at most "
                f"{budget} characters with release name {release!r} (the chart names the Service "
                "'<release>-<name>-engine-service', at most 63 characters)")
    else:
        name = _dns_name(served, budget)

    replicas = _int(opts.get("replica_count", 1), "options.replica_count")
    if replicas < 0:
        raise AnsibleFilterError(f"options.replica_count: {replicas} is negative")
    if chat_template_seen and not isinstance(opts.get("chat_template"), str):
        raise AnsibleFilterError(
            "vllm_argv: '--chat-template' names a file mounted on the box, which the pod does not have; the chart "
            "ships a template as a ConfigMap (chatTemplate, chatTemplateConfigMap): pass its text as "
            "options.chat_template (playbooks/handover.yml does when vllm_chat_template is set)")

    annotations = {
        "teamserve/image": f"{parts['repository']}:{parts['tag']}@{parts['digest']}",
        "teamserve/image-digest": str(parts["digest"]),
        "teamserve/chart": f"{CHART_NAME} {CHART_VERSION}",
    }
    if spec.get("modelRevision"):
        annotations["teamserve/model-revision"] = spec["modelRevision"]
    numbers = plan.get("numbers") if isinstance(plan.get("numbers"), Mapping) else {}
    if numbers.get("gpu"):
        annotations["teamserve/planned-for"] = (
            f"{numbers.get('gpu_count', parallel['--tensor-parallel-size'])} x {numbers['gpu']}"
            f" ({numbers.get('gpu_total_gib', '?')} GiB in all), {numbers.get('kv_tokens', '?')} KV cache tokens")

    model_spec: dict[str, Any] = {
        "name": name,
        "annotations": annotations,
        "repository": str(parts["repository"]),
        # The chart builds the image as "<repository>:<tag>" and reads tag nowhere else, so the digest rides in
        # the tag: "vllm/vllm-openai:v0.32.0@sha256:..." is pulled by digest.
        "tag": f"{parts['tag']}@{parts['digest']}",
        "modelURL": model_url,
        **({"modelRevision": spec["modelRevision"]} if spec.get("modelRevision") else {}),
        "replicaCount": replicas,
        "requestCPU": _int(opts.get("request_cpu", 6), "options.request_cpu"),
        "requestMemory": str(opts.get("request_memory") or "16Gi"),
        "requestGPU": parallel["--tensor-parallel-size"] * parallel["--pipeline-parallel-size"]
        * parallel["--data-parallel-size"],
        "enableLoRA": bool(spec.get("enableLoRA", False)),
        "vllmConfig": vllm_config,
    }
    if opts.get("pvc_storage"):
        model_spec["pvcStorage"] = str(opts["pvc_storage"])
    if chat_template_seen:
        model_spec["chatTemplate"] = "chat-template.jinja"
        model_spec["chatTemplateConfigMap"] = chart_chat_template(str(opts["chat_template"]))
    hf_token = _secret_ref(opts.get("hf_token_secret"), "hf_token_secret", None)
    if hf_token:
        model_spec["hf_token"] = hf_token
    env = opts.get("env") or {}
    if not isinstance(env, Mapping):
        raise AnsibleFilterError(f"options.env: expected a mapping of variable names to values; got {type(env).__name__}")
    for variable in env:
        if _SECRETISH.search(str(variable)):
            raise AnsibleFilterError(
                f"options.env: '{variable}' looks like a secret and would be written into the values file; put it "
                "in a Kubernetes Secret and reference it (modelSpec.envFromSecret) instead")
    if env:
        model_spec["env"] = [{"name": str(k), "value": str(v)} for k, v in sorted(env.items())]

    values: dict[str, Any] = {"servingEngineSpec": {"modelSpec": [model_spec]}}
    if key_flag_seen:
        values["servingEngineSpec"]["vllmApiKey"] = _secret_ref(
            opts.get("api_key_secret"), "api_key_secret", {"secretName": "teamserve-vllm-api-key", "secretKey": "api-key"})
    teamserve_production_stack_check(values)
    return values


def chart_chat_template(text: str) -> str:
    """The chat template text to put in ``chatTemplateConfigMap`` so the pod's engine renders what the box's did.

    The chart writes the ConfigMap as ``<file>: |-`` followed by ``{{ chatTemplateConfigMap | nindent 4 }}``:
    the file then starts with a newline the template never had (a newline at the start of every prompt) and
    loses all its trailing newlines. vLLM renders chat templates with transformers' Jinja environment
    (trim_blocks and lstrip_blocks on, one trailing newline dropped). So the text gets a first line of its own,
    a ``{#- ... #}`` comment that strips the chart's newline and whose own line end trim_blocks removes (the
    template's first line stays at a line start, for lstrip_blocks); the one trailing newline Jinja would drop
    is dropped here, and when more remain an empty ``{{ '' }}`` after them keeps them.
    """
    body = text[:-1] if text.endswith("\n") else text
    if body.endswith("\n"):
        body += "{{ '' }}"
    return "{#- teamserve: strips the newline the chart puts before the template #}\n" + body


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        return isinstance(value, Mapping)
    if kind == "array":
        return isinstance(value, list)
    if kind == "labels":
        return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    raise AssertionError(kind)  # pragma: no cover - the descriptions above use only these


def _describe(description: Any) -> str:
    if isinstance(description, str):
        return {"labels": "a mapping of strings to strings"}.get(description, description)
    if isinstance(description, tuple):
        return " or ".join(_describe(d) for d in description)
    if isinstance(description, frozenset):
        return f"one of {sorted(description)}"
    if isinstance(description, dict):
        return "a mapping"
    return f"a list of {_describe(description[0])}"


def _check(value: Any, description: Any, path: str) -> None:
    if isinstance(description, dict):
        if not isinstance(value, Mapping):
            raise AnsibleFilterError(f"{path}: expected a mapping, got {type(value).__name__}")
        for key, item in value.items():
            if key not in description:
                raise AnsibleFilterError(
                    f"{path}.{key}: not a key of production-stack's chart {CHART_VERSION} here (known: "
                    f"{', '.join(sorted(description))})")
            _check(item, description[key], f"{path}.{key}")
        return
    if isinstance(description, list):
        if not isinstance(value, list):
            raise AnsibleFilterError(f"{path}: expected {_describe(description)}, got {type(value).__name__}")
        for index, item in enumerate(value):
            _check(item, description[0], f"{path}[{index}]")
        return
    if isinstance(description, frozenset):
        if value not in description:
            raise AnsibleFilterError(f"{path}: {value!r} is not {_describe(description)}")
        return
    kinds = description if isinstance(description, tuple) else (description,)
    if not any(_type_ok(value, kind) for kind in kinds):
        shown = "a mapping" if isinstance(value, Mapping) else repr(value)
        raise AnsibleFilterError(f"{path}: expected {_describe(description)}, got {shown} ({type(value).__name__})")


def teamserve_production_stack_check(values: Any) -> bool:
    """Check a values dict against the chart keys this module knows (``VALUES_KEYS``, from chart 0.1.12).

    Input: the values as a dict. Output: True. Raises AnsibleFilterError with the dotted path of the first
    bad key (``servingEngineSpec.modelSpec[0].vllmConfig.maxNumSeqs``) for: a key the description does not
    have (the chart would ignore it silently), a value of the wrong type or outside the chart's enum, and in
    ``vllmConfig.extraArgs`` the engine's key (``--api-key``, ``--config``) or a flag the chart sets itself
    (``--host``, ``--port``).
    """
    _check(values, VALUES_KEYS, "values")
    for m, spec in enumerate(values.get("servingEngineSpec", {}).get("modelSpec", [])):
        for a, token in enumerate((spec.get("vllmConfig") or {}).get("extraArgs") or []):
            flag = _canonical(token.partition("=")[0]) if _is_flag(token) else ""
            if flag in _KEY_FLAGS or flag in _CHART_SETS:
                why = ("the engine's key goes through servingEngineSpec.vllmApiKey (a Secret reference)"
                       if flag in _KEY_FLAGS else _CHART_SETS[flag])
                raise AnsibleFilterError(f"values.servingEngineSpec.modelSpec[{m}].vllmConfig.extraArgs[{a}]: "
                                         f"'{flag}' does not belong here: {why}")
    return True


def teamserve_production_stack_header(values: Any, pins: Any, host: str, argv: Any = ()) -> str:
    """The comment block on top of the written values file (ends with a newline; no secret in it).

    Inputs: the values (for the Secret names), ``pins`` (``teamserve_lock_now``: lock key -> pinned version),
    the inventory host, and the box's argv (shown for comparison; the key flags carry only a file path).
    """
    engine = values["servingEngineSpec"]
    spec = engine["modelSpec"][0]
    lines = [
        f"vLLM production-stack values for the engine teamserve planned on {host} (playbooks/handover.yml).",
        f"Checked against chart {CHART_NAME} {CHART_VERSION} ({CHART_SOURCE}).",
        f"  helm repo add vllm {CHART_REPO_URL}",
        f"  helm install <release> vllm/{CHART_NAME} --version {CHART_VERSION} -f <this file> [-f <your own values>]",
        "The engine's key is not in this file: create the Secret first (docs/handover.md):",
    ]
    key = engine.get("vllmApiKey")
    if key:
        lines.append(f"  kubectl create secret generic {key['secretName']} --from-file={key['secretKey']}=<key file>")
    if spec.get("hf_token"):
        lines.append(f"  kubectl create secret generic {spec['hf_token']['secretName']} "
                     f"--from-file={spec['hf_token']['secretKey']}=<Hugging Face token file>")
    lines.append("teamserve pins (the inventory's lock file):")
    lines.extend(f"  {k}: {v if v not in ('', None) else '(not pinned)'}" for k, v in (pins or {}).items())
    if argv:
        lines.append("Engine argv on the box: " + " ".join(_masked(argv)))
    return "".join(f"# {line}\n" for line in lines)


def _masked(argv: Any) -> list[str]:
    """The argv with the values of ``--api-key`` replaced by ``<hidden>`` (``--config`` carries a path only)."""
    shown: list[str] = []
    hiding = False
    for token in (str(t) for t in argv):
        flag = _canonical(token.partition("=")[0]) if _is_flag(token) else ""
        if flag:
            hiding = flag == "--api-key"
            shown.append(f"{token.partition('=')[0]}=<hidden>" if hiding and "=" in token else token)
        else:
            shown.append("<hidden>" if hiding else token)
    return shown


class FilterModule:
    """The hand-over to a cluster engine (playbooks/handover.yml)."""

    def filters(self) -> dict[str, Any]:
        return {"teamserve_production_stack_values": teamserve_production_stack_values,
                "teamserve_production_stack_check": teamserve_production_stack_check,
                "teamserve_production_stack_header": teamserve_production_stack_header}
