"""``--model org/name`` resolved to local files through ``huggingface_hub``.

A Hub name becomes the same thing a user could have pointed ``--model`` at by hand: a
Hugging Face checkpoint folder (the cache's snapshot folder) or a ``.gguf`` file, which
:mod:`.local_model` then converts and loads as it does local paths. This module only picks
the files and asks ``huggingface_hub`` for them; it speaks no HTTP itself.

Names: ``org/name[@revision]`` (config, tokenizer and safetensors weights),
``org/name[@revision]:QUANT`` (the GGUF whose file name carries that quantization) and
``org/name[@revision]/FILE.gguf`` (that file). The files live in the standard cache
(``HF_HUB_CACHE``, else ``HF_HOME``/hub), so other tools share them. ``HF_TOKEN``,
``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are read at each call (not at import), so a command
and a test that set them late are both honoured. Offline, nothing is requested: the files are
chosen from the cached snapshot by the same rules.
"""
from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

from .. import switches
from ..config import ConfigError
from .hub_files import (
    HubName,
    check_hub_name,
    choose_gguf,
    choose_hf,
    parse_hub_name,
    safe_file_name,
    shard_set,
)

OFFLINE_ENV = switches.HF_HUB_OFFLINE.name
_TRUE = {"1", "true", "yes", "on"}
# what a checkpoint folder needs besides its weights: the config, the tokenizer, the template
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                "tokenizer.model", "chat_template.jinja")


def offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` (which ``--offline`` sets): the cache only, no request at all."""
    return switches.HF_HUB_OFFLINE.get()


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps repositories, by its own rules, read now."""
    if switches.HF_HUB_CACHE.get():
        return switches.HF_HUB_CACHE.get()
    home = switches.HF_HOME.get()
    if not home:
        home = (switches.XDG_CACHE_HOME.get() or Path.home() / ".cache") / "huggingface"
    return home / "hub"


def _endpoint() -> str:
    return switches.HF_ENDPOINT.get().rstrip("/")


def _token() -> str | None:
    return switches.HF_TOKEN.get()  # None: huggingface_hub's saved login, if any


def _client():
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError("--model org/name needs huggingface_hub; pip install huggingface_hub "
                          "(or download the repo and pass its folder)") from None
    return huggingface_hub


_NETWORK = ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException",
            "NetworkError", "ConnectionError", "RemoteProtocolError", "ReadError", "ProxyError",
            "PoolTimeout", "MaxRetryError", "NewConnectionError")


def _is_network_error(e: BaseException | None) -> bool:
    """A connection that could not be made or was lost (the client's HTTP library varies by
    version, so its exceptions are known by name); an HTTP answer is never one."""
    from huggingface_hub.errors import HfHubHTTPError

    while e is not None:
        if isinstance(e, HfHubHTTPError):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _NETWORK:
            return True
        e = e.__cause__ or e.__context__
    return False


def _fix_for(name: HubName, e: BaseException) -> ConfigError:
    """The one error line for what ``huggingface_hub`` raised, naming the fix."""
    from huggingface_hub import errors as hf

    page = f"{_endpoint()}/{name.repo}"
    if isinstance(e, hf.GatedRepoError):
        how = "HF_TOKEN is set, so accept" if _token() else "accept"
        return ConfigError(f"--model {name}: {name.repo} is a gated repository; {how} its "
                           f"license at {page} and set HF_TOKEN to a token of that account")
    if isinstance(e, hf.RepositoryNotFoundError):
        return ConfigError(f"--model {name}: no repository {name.repo} on {_endpoint()} (and no "
                           "local file or folder of that name); check the name, or set "
                           "HF_TOKEN if it is private")
    if isinstance(e, hf.RevisionNotFoundError):
        return ConfigError(f"--model {name}: {name.repo} has no revision {name.rev!r}; give a "
                           "branch, tag or commit it has")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ConfigError(f"--model {name}: no room to write the download in {hub_cache_dir()} "
                           f"({os.strerror(e.errno)}); free space or point HF_HUB_CACHE at a "
                           "bigger disk and run again (finished files are kept, nothing was "
                           "converted)")
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM,
                                              errno.ENOTDIR, errno.EEXIST):
        return ConfigError(f"--model {name}: cannot write the download in {hub_cache_dir()} "
                           f"({os.strerror(e.errno)}); point HF_HUB_CACHE at a writable "
                           "folder")
    if isinstance(e, hf.HfHubHTTPError) and getattr(e.response, "status_code", 0) in (401, 403):
        return ConfigError(f"--model {name}: {_endpoint()} refused access to {name.repo} "
                           f"({e.response.status_code}); set HF_TOKEN to a token that can "
                           "read it")
    if offline_mode() or isinstance(e, hf.LocalEntryNotFoundError) or _is_network_error(e):
        return _not_cached(name, "" if offline_mode() else
                           f"{_endpoint()} cannot be reached ({_first_line(e)}) and ")
    return ConfigError(f"--model {name}: the Hub answered {_first_line(e)}; check the name "
                       "and HF_ENDPOINT")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip(": ")


def _not_cached(name: HubName, reason: str = "") -> ConfigError:
    if offline_mode():
        return ConfigError(f"--model {name}: offline (HF_HUB_OFFLINE or --offline) and not "
                           f"in the cache {hub_cache_dir()}; run once with the network, or "
                           "point HF_HUB_CACHE at a cache that holds it")
    return ConfigError(f"--model {name}: {reason}it is not in the cache {hub_cache_dir()}; "
                       "check the network (or HF_ENDPOINT), or download it once elsewhere "
                       "and set HF_HUB_CACHE")


def _cached_snapshot(name: HubName) -> Path | None:
    """The cached snapshot folder of the name's revision, found without any request. The
    revision was checked (:func:`.check_hub_name`); a ref file that names anything but a
    commit (a damaged or planted cache) finds nothing."""
    repo_dir = hub_cache_dir() / ("models--" + name.repo.replace("/", "--"))
    ref = repo_dir / "refs" / name.rev
    try:
        commit = ref.read_text().strip() if ref.is_file() else name.rev
    except (OSError, UnicodeDecodeError):
        return None
    if not safe_file_name(commit) or "/" in commit:
        return None
    folder = repo_dir / "snapshots" / commit
    return folder if folder.is_dir() else None


def _cached_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)).replace(os.sep, "/")
                  for p in folder.rglob("*") if p.is_file())


def _remote_files(name: HubName) -> list[str]:
    """The repository's file names as the Hub lists them; a name that would leave the
    snapshot folder is never asked for."""
    hub = _client()
    info = hub.HfApi(endpoint=_endpoint(), token=_token()).model_info(name.repo,
                                                                      revision=name.rev)
    return sorted(s.rfilename for s in (info.siblings or []) if safe_file_name(s.rfilename))


class _Quiet(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _download(name: HubName, files: list[str], progress: bool) -> Path:
    """The snapshot folder with ``files`` in it: ``huggingface_hub`` fetches what is missing
    (a tqdm bar; a dropped connection resumes with a Range request; each file is written
    under a temporary name and moved into place whole, so a failed download leaves no file
    that looks finished)."""
    hub = _client()
    extra = {} if progress else {"tqdm_class": _Quiet}
    folder = hub.snapshot_download(name.repo, revision=name.rev, allow_patterns=files,
                                   cache_dir=str(hub_cache_dir()), endpoint=_endpoint(),
                                   token=_token(), **extra)
    return Path(folder)


def _index_shards(name: HubName, index: str, online: bool) -> list[str]:
    """The weight files a ``*.index.json`` names (fetched first when online)."""
    hub = _client()
    if online:
        path = hub.hf_hub_download(name.repo, index, revision=name.rev,
                                   cache_dir=str(hub_cache_dir()), endpoint=_endpoint(),
                                   token=_token())
    else:
        path = _cached_snapshot(name) / index
    try:
        weight_map = json.loads(Path(path).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--model {name}: its {index} cannot be read ({e}); the repository "
                          "is broken, or pick another revision") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and safe_file_name(f) for f in weight_map.values()):
        raise ConfigError(f"--model {name}: its {index} names a file outside the repository "
                          "(or no file); the repository is broken, or pick another revision")
    folder = index.rpartition("/")[0]
    return sorted({f"{folder}/{f}" if folder else f for f in weight_map.values()})


def _wants_gguf(name: HubName, listing: list[str]) -> bool:
    """A GGUF is asked for by name, or the repo has no other weights."""
    return bool(name.quant or name.file) or not any(f.endswith((".safetensors", ".bin"))
                                                    for f in listing)


def _pick(name: HubName, listing: list[str], online: bool) -> list[str]:
    """The repository files the name needs, from a listing of the repo or of its cache."""
    if _wants_gguf(name, listing):
        return choose_gguf(str(name), listing, name.quant, name.file)
    weights, index = choose_hf(str(name), listing)
    if index:
        weights = [index] + _index_shards(name, index, online)
    return sorted(set(weights) | {f for f in listing if f in CONFIG_FILES})


def resolve(model: str, progress: bool = True, config_only: bool = False) -> Path:
    """The local checkpoint folder or ``.gguf`` file of a Hub name, downloaded into the Hub
    cache when not there yet. ``config_only``: for a checkpoint repo, fetch only
    ``config.json`` (a GGUF carries its config inside, so it comes whole)."""
    name = parse_hub_name(model)
    if name is None:
        raise ConfigError(f"--model {model} is not a Hub name (org/name); give org/name, a "
                          ".gguf file or a local folder")
    check_hub_name(name)  # before any request, and before the cache is looked at
    try:
        return _resolve(name, progress, config_only)
    except ConfigError:
        raise
    except Exception as e:  # the client's errors, and the disk's, become one line each
        raise _fix_for(name, e) from None


def _resolve(name: HubName, progress: bool, config_only: bool) -> Path:
    online = not offline_mode()
    listing = None
    if online:
        try:
            listing = _remote_files(name)
        except Exception as e:
            if not _is_network_error(e):
                raise
            if _cached_snapshot(name) is None:
                raise _not_cached(name, f"{_endpoint()} cannot be reached "
                                        f"({_first_line(e)}) and ") from None
            print(f"{_endpoint()} cannot be reached; using the cached {name.repo}",
                  file=sys.stderr, flush=True)
            online = False
    if not online:
        cached = _cached_snapshot(name)
        if cached is None:
            raise _not_cached(name)
        listing = _cached_files(cached)
    try:  # config_only: the weights are not wanted yet (nor their index)
        files = ["config.json"] if config_only and "config.json" in listing and \
            not _wants_gguf(name, listing) else _pick(name, listing, online)
    except ConfigError as e:
        if online:
            raise
        raise ConfigError(f"{e} (offline: the cache holds only what was fetched before; run "
                          "once with the network for another file)") from None
    gguf = [f for f in files if f.endswith(".gguf")]
    if online:
        folder = _download(name, files, progress)
    else:
        folder = _cached_snapshot(name)
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConfigError(f"--model {name}: the cached copy lacks {len(missing)} file(s) "
                              f"(first: {missing[0]}); run once with the network to finish "
                              "the download")
    if not gguf:
        return folder
    # a split GGUF is named by its first shard: the GGUF loader reads every shard in that
    # folder as one file (weights/gguf_shards.py), so nothing is joined into a copy
    return folder / shard_set(str(name), gguf)[0]  # gguf: safe names (see _remote_files)

