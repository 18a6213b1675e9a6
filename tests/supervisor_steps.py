"""What Home Assistant's Supervisor does with an add-on repository before and while it builds and starts an add-on,
written here after reading its source (home-assistant/supervisor: store/git.py, store/data.py, store/validate.py,
store/utils.py, addons/validate.py, addons/options.py, addons/build.py, docker/addon.py), for tests/test_deploy.py
and tests/test_addon.py. It is not imported from the Supervisor: that is no package on an index and runs only
inside Home Assistant. What is reproduced, and what is not:

- The store: a repository URL is cloned whole (depth 1) into a folder named by the first 8 hex digits of the SHA-1
  of the lower-cased URL; the repository is listed only when ``repository.(json|yaml|yml)`` sits at the clone's
  root and has a ``name`` (``url`` and ``maintainer`` optional). Add-ons are every ``config.(json|yaml|yml)``
  anywhere below the root, skipping paths with a part that starts with ``.`` or is ``rootfs``; a file that does
  not validate as an add-on config is skipped with a warning, as the Supervisor logs and skips it. The add-on's
  slug is ``<repository hash>_<config slug>``, its container's hostname that slug with ``-`` for ``_``.
- The add-on config: the required keys (name, version, slug, description, arch) and the values of the keys this
  repository's add-on uses (startup, boot, init, ports, map, discovery, options, schema, ...). The Supervisor
  drops keys it does not know without a word; here they are refused, so a misspelt key fails a test.
- Options: the schema element grammar ``str``, ``password``, ``int``, ``float`` (each with an optional
  ``(min,max)``), ``bool``, ``list(a|b|...)`` and ``match(REGEX)``, each optionally ending in ``?``; a value of
  ``None`` is a missing option; keys outside the schema are dropped; a missing key whose element lacks ``?``
  is an error. ``str(min,max)`` bounds the length, as Home Assistant's add-on documentation says. The
  ``email``, ``url``, ``port`` and ``device`` elements and ``!secret`` values are not reproduced (refused).
  ``/data/options.json`` is the config's default options overlaid by the user's, validated, as JSON.
- The build: build.yaml's ``build_from`` for the architecture (or its one image), the build arguments
  BUILD_FROM, BUILD_VERSION and BUILD_ARCH plus build.yaml's ``args``, the ``io.hass.*`` labels plus build.yaml's,
  the tag ``local/<arch>-addon-<slug>:<version>``, and ``--pull`` (the base is always pulled from its registry).
Not reproduced: Git itself, translations' schema, ingress, devices, AppArmor, the host's architecture list."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
ARCHES = ("aarch64", "amd64", "armhf", "armv7", "i386")
SLUG = re.compile(r"^[-_.A-Za-z0-9]+$")
IMAGE = re.compile(r"^([a-zA-Z0-9.\-:{}]+/)*?[\w\-{}]+/[\w\-{}]+(:[\w.\-{}]+)?$")  # a namespace/name image
PORT_KEY = re.compile(r"^\d+(/(tcp|udp))?$")
MAP_TYPES = ("data", "config", "ssl", "addons", "backup", "share", "media", "homeassistant_config",
             "all_addon_configs", "addon_config")
CHOICES = {"startup": ("initialize", "system", "services", "application", "once"),
           "boot": ("auto", "manual", "manual_only"), "stage": ("stable", "experimental", "deprecated")}
# the add-on config keys the Supervisor knows (addons/validate.py); any other is dropped there, refused here
KNOWN_KEYS = {
    "name", "version", "slug", "description", "arch", "machine", "url", "startup", "boot", "init", "advanced",
    "stage", "ports", "ports_description", "watchdog", "webui", "ingress", "ingress_port", "ingress_entry",
    "ingress_stream", "panel_icon", "panel_title", "panel_admin", "homeassistant", "host_network", "host_pid",
    "host_ipc", "host_uts", "host_dbus", "devices", "udev", "tmpfs", "map", "environment", "privileged",
    "apparmor", "full_access", "audio", "video", "gpio", "usb", "uart", "devicetree", "kernel_modules",
    "realtime", "hassio_api", "hassio_role", "homeassistant_api", "stdin", "legacy", "docker_api", "auth_api",
    "services", "discovery", "backup_exclude", "backup_pre", "backup_post", "backup", "options", "schema",
    "image", "ulimits", "timeout", "journald", "breaking_versions"}
ELEMENT = re.compile(r"^(?P<type>str|password|int|float|bool|list|match)(?:\((?P<arg>.*)\))?(?P<optional>\?)?$")


class Invalid(ValueError):
    """What the Supervisor refuses (its voluptuous ``Invalid``)."""


def copy_as_cloned(src: Path, dest: Path) -> Path:
    """What a clone of ``src``'s Git work tree holds once its changes are committed (tracked files, and untracked
    ones .gitignore keeps), copied to ``dest``: the store's clone, stood in without a Git server."""
    listed = subprocess.run(["git", "-C", str(src), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (src / rel).is_file():  # a tracked file deleted in the work tree is gone from the next commit
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dest / rel)
    return dest


def read_file(path: Path):
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def repository_hash(url: str) -> str:
    """The clone's folder name and the first part of its add-ons' slugs."""
    return hashlib.sha1(url.lower().encode()).hexdigest()[:8]


def read_repository(root: Path) -> dict:
    """The repository's own file at the clone's root, validated; :class:`Invalid` when there is none."""
    found = [root / f"repository{s}" for s in CONFIG_SUFFIXES if (root / f"repository{s}").is_file()]
    if not found:
        raise Invalid(f"no repository information at {root} (repository.yaml must sit at the repository's root)")
    data = read_file(found[0])
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise Invalid(f"{found[0]}: a repository needs a name")
    if "url" in data and not str(data["url"]).startswith(("http://", "https://")):
        raise Invalid(f"{found[0]}: url {data['url']!r} is no URL")
    return {k: data[k] for k in ("name", "url", "maintainer") if k in data}


def find_addon_configs(root: Path) -> list[Path]:
    """Every file the store tries as an add-on config, as its glob finds them."""
    return sorted(p for p in root.glob("**/config.*") if p.suffix in CONFIG_SUFFIXES
                  and not any(part.startswith(".") or part == "rootfs" for part in p.relative_to(root).parts))


def validate_config(config) -> dict:
    """An add-on config as the store accepts it, or :class:`Invalid` naming the first problem."""
    if not isinstance(config, dict) or not config.get("name"):
        raise Invalid("Invalid Add-on config!")
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise Invalid(f"keys the Supervisor does not know (it drops them): {unknown}")
    for key in ("version", "slug", "description"):
        if not isinstance(config.get(key), str):
            raise Invalid(f"{key} is required, a string")
    if not SLUG.match(config["slug"]):
        raise Invalid(f"slug {config['slug']!r}")
    if not isinstance(config.get("arch"), list) or not set(config["arch"]) <= set(ARCHES):
        raise Invalid(f"arch {config.get('arch')!r}: a list of {ARCHES}")
    for key, allowed in CHOICES.items():
        if key in config and config[key] not in allowed:
            raise Invalid(f"{key} {config[key]!r}; allowed: {allowed}")
    for key in ("init", "advanced", "host_network", "hassio_api", "homeassistant_api", "ingress", "stdin"):
        if key in config and not isinstance(config[key], bool):
            raise Invalid(f"{key} must be a boolean")
    for port, host in (config.get("ports") or {}).items():
        if not PORT_KEY.match(str(port)) or not (host is None or isinstance(host, int) and 0 < host < 65536):
            raise Invalid(f"port {port!r}: {host!r}")
    for entry in config.get("map") or []:
        kind = entry.get("type") if isinstance(entry, dict) else str(entry).split(":")[0]
        if kind not in MAP_TYPES:
            raise Invalid(f"map entry {entry!r}")
    if not all(isinstance(s, str) for s in config.get("discovery") or []):
        raise Invalid("discovery must be a list of service names")
    if "url" in config and not str(config["url"]).startswith(("http://", "https://")):
        raise Invalid(f"url {config['url']!r}")
    options, schema = config.get("options", {}), config.get("schema", {})
    if not isinstance(options, dict) or not isinstance(schema, dict):
        raise Invalid("options and schema must be mappings")
    for key, element in schema.items():
        if not isinstance(element, str) or not ELEMENT.match(element):
            raise Invalid(f"schema {key}: element {element!r} (not one this reproduction knows)")
    return config


def discover(root: Path) -> tuple[dict, dict[str, dict], list[str]]:
    """The store's reading of a clone at ``root`` (a folder named by its URL's hash): (repository, {add-on slug:
    config with its ``location``}, warnings for the files it skipped)."""
    repository = read_repository(root)
    addons, warnings = {}, []
    for path in find_addon_configs(root):
        try:
            config = validate_config(read_file(path))
        except (Invalid, ValueError, yaml.YAMLError) as e:
            warnings.append(f"Can't read {path.relative_to(root)}: {e}")
            continue
        addons[f"{root.name}_{config['slug']}"] = {**config, "location": path.parent}
    return repository, addons, warnings


def _bounds(arg: str | None, cast) -> tuple:
    if not arg:
        return None, None
    low, _, high = arg.partition(",")
    return (cast(low) if low else None), (cast(high) if high else None)


def validate_option(element: str, value, key: str):
    """One option's value as the Supervisor keeps it, or :class:`Invalid`."""
    if value is None:
        raise Invalid(f"Missing required option '{key}'")
    m = ELEMENT.match(element)
    kind, arg = m["type"], m["arg"]
    if isinstance(value, str) and value.startswith("!secret "):
        raise Invalid(f"option '{key}': secrets are not reproduced")
    if kind in ("str", "password"):
        if not isinstance(value, str):
            raise Invalid(f"option '{key}': {value!r} is not a string")
        low, high = _bounds(arg, int)
        if (low is not None and len(value) < low) or (high is not None and len(value) > high):
            raise Invalid(f"option '{key}': length {len(value)} outside ({low},{high})")
        return value
    if kind in ("int", "float"):
        cast = int if kind == "int" else float
        try:
            number = cast(value)
        except (TypeError, ValueError):
            raise Invalid(f"option '{key}': {value!r} is not {kind}") from None
        low, high = _bounds(arg, float)
        if (low is not None and number < low) or (high is not None and number > high):
            raise Invalid(f"option '{key}': {number} outside ({low},{high})")
        return number
    if kind == "bool":
        if not isinstance(value, bool):
            raise Invalid(f"option '{key}': {value!r} is not a boolean")
        return value
    if kind == "list":
        if str(value) not in arg.split("|"):
            raise Invalid(f"option '{key}': {value!r} not in {arg.split('|')}")
        return str(value)
    if not re.match(arg, str(value)):  # match(REGEX)
        raise Invalid(f"option '{key}': {value!r} does not match {arg}")
    return str(value)


def validate_options(schema: dict, options: dict) -> dict:
    """The options the Supervisor writes for ``schema``: unknown keys dropped, each value checked, every key
    whose element lacks ``?`` present."""
    out = {key: validate_option(schema[key], value, key) for key, value in options.items() if key in schema}
    missing = [key for key, element in schema.items() if key not in out and not element.endswith("?")]
    if missing:
        raise Invalid(f"Missing option '{missing[0]}' in root")
    return out


def write_options(config: dict, user_options: dict, data_dir: Path) -> dict:
    """``/data/options.json`` as the Supervisor writes it before starting the add-on."""
    options = validate_options(config.get("schema") or {}, {**config.get("options", {}), **user_options})
    (data_dir / "options.json").write_text(json.dumps(options))
    return options


def build_plan(config: dict, slug: str, arch: str) -> dict:
    """The Supervisor's build of the add-on at ``config['location']`` for ``arch``: its base image, build
    arguments, labels and tag (addons/build.py)."""
    location = Path(config["location"])
    found = [location / f"build{s}" for s in CONFIG_SUFFIXES if (location / f"build{s}").is_file()]
    build = (read_file(found[0]) if found else None) or {}
    if not (location / "Dockerfile").is_file():
        raise Invalid(f"{location}: no Dockerfile, an invalid build environment")
    build_from = build.get("build_from") or f"ghcr.io/home-assistant/{arch}-base:latest"
    if isinstance(build_from, dict):
        if arch not in build_from:
            raise Invalid(f"build_from has no image for {arch}")
        build_from = build_from[arch]
    if not IMAGE.match(build_from):
        raise Invalid(f"build_from {build_from!r} is not an image name")
    args, labels = build.get("args") or {}, build.get("labels") or {}
    if not all(isinstance(v, str) for v in (*args.values(), *labels.values())):
        raise Invalid("build.yaml's args and labels must be strings")
    version = str(config["version"])
    return {"base": build_from, "context": location, "pull": True,
            "args": {"BUILD_FROM": build_from, "BUILD_VERSION": version, "BUILD_ARCH": arch, **args},
            "labels": {"io.hass.version": version, "io.hass.arch": arch, "io.hass.type": "addon",
                       "io.hass.name": config["name"].replace("'", ""),
                       "io.hass.description": config["description"].replace("'", ""),
                       **({"io.hass.url": config["url"]} if config.get("url") else {}), **labels},
            "tag": f"local/{arch}-addon-{slug}:{version}"}


def hostname(slug: str) -> str:
    """The add-on container's hostname, which its discovery message names."""
    return slug.replace("_", "-")
