"""Hub names (``org/name[@revision][:QUANT]``, ``org/name[@revision]/FILE.gguf``) and
which files of a Hub repository a model needs, chosen from the list of its file names
(the Hub's listing, or the cached snapshot's when offline): the safetensors weights (those
an index names, else the top-level ones; ``.bin`` only when there are none), or the GGUF
file a quantization or a file name picks, with every shard of a split GGUF."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ConfigError

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
# a git ref cannot hold ':' (git check-ref-format), so ':' safely starts the quantization
_NAME = re.compile(rf"(?P<repo>{_SEGMENT}/{_SEGMENT})(?:@(?P<rev>[^:@\s]+?))?"
                   rf"(?::(?P<quant>[A-Za-z0-9_.-]+))?(?:/(?P<file>[^@:\s]+\.gguf))?")


@dataclass(frozen=True)
class HubName:
    repo: str
    revision: str | None = None
    quant: str | None = None
    file: str | None = None

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def __str__(self) -> str:
        return (self.repo + (f"@{self.revision}" if self.revision else "")
                + (f":{self.quant}" if self.quant else "") + (f"/{self.file}" if self.file else ""))


def parse_hub_name(model: str | None) -> HubName | None:
    """The Hub name ``model`` spells, or None. Paths that say they are paths (``/``, ``./``,
    ``~``) never are; whether a local file of that name exists is the caller's question."""
    if not model or model.startswith(("/", ".", "~")) or "\\" in model:
        return None
    m = _NAME.fullmatch(model)
    if m is None or (m["quant"] and m["file"]):
        return None
    if not m["file"] and m["repo"].endswith(".gguf"):  # dir/x.gguf: a file that is not there
        return None
    return HubName(m["repo"], m["rev"], m["quant"], m["file"])


# what may name a revision: a branch, tag or commit (one segment, as git spells them), or a
# pull request's ref, refs/pr/N; never a path (no separator, "..", or absolute path), so
# that no revision names a folder outside the repository's part of the cache
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}|refs/pr/[0-9]{1,9}")
_REPO_MAX = 96  # the Hub's limit on a repository name


def check_hub_name(name: HubName) -> None:
    """One error naming the fix when a Hub name's repository, revision or file could name
    something outside the Hub cache (``..``, a separator, an absolute path)."""
    owner, _, repo = name.repo.partition("/")
    if any("--" in part or ".." in part or part.endswith(".") or len(part) > _REPO_MAX
           for part in (owner, repo)):
        raise ConfigError(f"--model {name}: {name.repo!r} is not a Hub repository name "
                          "(letters, digits, '-', '_' and '.', no '--' or '..', at most "
                          f"{_REPO_MAX} characters each side of the '/'); check the name")
    rev = name.revision
    if rev is not None and (not _REVISION.fullmatch(rev) or ".." in rev
                            or rev.endswith((".", ".lock"))):
        raise ConfigError(f"--model {name}: the revision {rev!r} is not a branch, tag or "
                          "commit name (no '/', '\\' or '..'; a pull request is refs/pr/N); "
                          "give one the repository has")
    if name.file is not None and not safe_file_name(name.file):
        raise ConfigError(f"--model {name}: the file {name.file!r} is not a file name inside "
                          "the repository (no '..', '\\' or leading '/'); give the file's "
                          "path as the repository lists it")


def safe_file_name(path: str) -> bool:
    """A repository file's name that stays inside its folder: relative, '/'-separated, with
    no empty, '.' or '..' part."""
    parts = path.split("/")
    return bool(path) and "\\" not in path and "\0" not in path and \
        all(p not in ("", ".", "..") for p in parts)


# llama.cpp's gguf-split names: <prefix>-00001-of-00003.gguf
_SHARD = re.compile(r"(?P<prefix>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf")
# a quantization as file names carry it: Q4_K_M, q8_0, IQ4_XS, UD-Q4_K_XL, BF16, F16
_QUANT = re.compile(r"(?i)(?<![A-Za-z0-9])((?:UD-)?I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[-.])")
_SHOWN = 12


def _base(f: str) -> str:
    return f.rsplit("/", 1)[-1]


def choose_hf(label: str, listing: list[str]) -> tuple[list[str], str | None]:
    """(weight files, their index or None) of a checkpoint repository."""
    top = [f for f in listing if "/" not in f]
    for index, suffix in (("model.safetensors.index.json", ".safetensors"),
                          ("pytorch_model.bin.index.json", ".bin")):
        if index in top:
            return [], index
        files = [f for f in top if f.endswith(suffix)]
        preferred = [f for f in files if f.startswith(("model", "pytorch_model"))]
        if preferred or files:
            return preferred or files, None
    raise ConfigError(f"--model {label}: the repository holds no top-level .safetensors "
                      "weights; if it holds GGUF files, name one with org/name:QUANT")


def quants_of(files: list[str]) -> list[str]:
    """The quantizations the GGUF file names carry, upper-cased and sorted."""
    seen = []
    for f in files:
        m = _QUANT.search(_base(f))
        if m and m.group(1).upper() not in seen:
            seen.append(m.group(1).upper())
    return sorted(seen)


def _groups(files: list[str]) -> dict[tuple, list[str]]:
    """Files grouped into models: a split GGUF's shards together, any other file alone."""
    out: dict[tuple, list[str]] = {}
    for f in files:
        m = _SHARD.fullmatch(f)
        key = (m["prefix"], m["n"]) if m else (f,)
        out.setdefault(key, []).append(f)
    return out


def shard_set(label: str, files: list[str]) -> list[str]:
    """One model's files in shard order, each shard from 1 to N present, or one error."""
    if len(files) == 1 and not _SHARD.fullmatch(files[0]):
        return files
    found, total = {}, None
    for f in files:
        m = _SHARD.fullmatch(f)
        if m is None or (total is not None and int(m["n"]) != total):
            raise ConfigError(f"--model {label}: {f} is not a shard of the same split GGUF as "
                              f"{files[0]}; name one model's files")
        total = int(m["n"])
        found[int(m["i"])] = f
    missing = [i for i in range(1, total + 1) if i not in found]
    if missing:
        name = _SHARD.fullmatch(files[0])["prefix"]
        raise ConfigError(f"--model {label}: shard {missing[0]} of {total} of {_base(name)} "
                          f"is missing ({len(missing)} missing in all); a split GGUF needs "
                          "every shard: fix the repository or pick another quantization")
    return [found[i] for i in range(1, total + 1)]


def _shown(items: list[str]) -> str:
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def choose_gguf(label: str, listing: list[str], quant: str | None,
                file: str | None) -> list[str]:
    """The GGUF file (or every shard of a split one) a name picks from a repository."""
    ggufs = [f for f in listing if f.endswith(".gguf")]
    models = [f for f in ggufs if not _base(f).lower().startswith("mmproj")]  # vision parts
    if not ggufs:
        has = "safetensors weights: drop the :QUANT or file name" if any(
            f.endswith(".safetensors") for f in listing) else "no weights we read"
        raise ConfigError(f"--model {label}: the repository holds no .gguf file; it has {has}")
    if file is not None:
        if file not in ggufs:
            raise ConfigError(f"--model {label}: the repository has no {file}; its GGUF files "
                              f"are {_shown(ggufs)}")
        picked = next(g for g in _groups(ggufs).values() if file in g)
        return shard_set(label, picked)
    if quant is not None:
        pattern = re.compile(rf"(?i)(?:^|[-.]){re.escape(quant)}(?=[-.])")
        every, models = models, [f for f in models if pattern.search(_base(f))]
        if not models:
            have = quants_of(every)
            raise ConfigError(f"--model {label}: no GGUF file for quantization {quant}; the "
                              f"repository has {_shown(have) if have else _shown(every)}")
    groups = list(_groups(models).values())
    if len(groups) > 1:
        names = [g[0] for g in groups]
        what = f"quantization {quant} matches" if quant else "the repository holds"
        pick = "name one with org/name/FILE.gguf" if quant else \
            f"pick one with org/name:QUANT ({_shown(quants_of(names))})"
        raise ConfigError(f"--model {label}: {what} {len(groups)} GGUF files ({_shown(names)}); "
                          f"{pick}")
    if not groups:
        raise ConfigError(f"--model {label}: the repository holds only vision projector GGUFs "
                          f"({_shown(ggufs)}); name a model file with org/name/FILE.gguf")
    return shard_set(label, groups[0])
