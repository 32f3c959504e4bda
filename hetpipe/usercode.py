"""The user's own code a job names: its content hash, a fresh import of it, and errors that
say where.

Why one home: the CLI, the head and every worker import the module a job names
(``model.name = "pkg.module:function"``), each in its own long-lived process. Python's import
cache would keep the first copy each daemon imported, so a job submitted after the user
edited the file would silently train the old code, or fail on the cluster for a function
the CLI found. So each of them calls :func:`check_user_code` before the job starts:

- the module's file is located the way an import would find it (the import system's finders,
  without executing the module; a package above it is imported, as any import would);
- its source is hashed (sha256 of the file's bytes). Where the job carries the hash of the
  user's copy (the job key ``code``, which ``hetpipe submit`` fills in), a host whose copy
  differs refuses the job in one line naming the host, the file and both hashes;
- a module not yet loaded from exactly these bytes is (re-)executed from them, so the next
  job trains the edited code without ``hetpipe down``/``up``. The code run is compiled from
  the very bytes that were hashed (never a cached ``.pyc``);
- an import failure (no such module, an error in it, the factory missing) says which module,
  and where this host looked (its ``sys.path``) or which file it found; never a policy
  refusal (that is :func:`hetpipe.security.check_code`'s, checked before anything here).

A job may carry its modules' sources (the job key ``sources``, filled in by ``hetpipe submit``
where the cluster sets ``[security] ship_code``): a host then runs those bytes, written to a
content-addressed file of its own, instead of looking for a copy; each must match its hash.

Only the named module's own file is hashed and reloaded, not the modules it imports. A job
running keeps the code it started with: nothing here runs between a job's check and its end,
and ``build_model`` takes the module from ``sys.modules``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "SHOWN",
    "FunctionError",
    "UserCodeError",
    "check_user_code",
    "digest",
    "load_function",
    "named_code",
]

SHOWN = 12  # hex digits of a hash that messages show
_PATHS_SHOWN = 4  # sys.path entries an import failure lists

# module name -> (hash of the source it was executed from, the module object executed)
_LOADED: dict[str, tuple[str, ModuleType]] = {}
_LOCK = threading.Lock()  # a head checks jobs on several executor threads
_STARTED = time.time()  # a file older than this was imported as it is (see below)


class UserCodeError(ValueError):
    """A job's own code cannot be used on this host; ``str(e)`` is one line, ``key`` the job
    key naming the code (``"model.name"``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Named:
    """One piece of user code a job names: ``key`` = ``"module:function"``."""

    key: str  # the job key, "model.name"
    module: str
    function: str


def named_code(job: Any) -> list[Named]:
    """The user code ``job`` names (a job dict in the file's shape, or a ``JobSpec``): each
    ``"module:function"`` value of a code-naming key; builtins (no colon) are not user code."""
    if hasattr(job, "to_dict"):
        job = job.to_dict()
    out = []
    for key in ("model.name", "model.loss", "data.name", "data.collate", "lr_schedule.kind"):
        section, _, field = key.partition(".")
        table = job.get(section) if isinstance(job, Mapping) else None
        name = table.get(field) if isinstance(table, Mapping) else None
        if isinstance(name, str) and name.count(":") == 1:
            module, function = name.split(":")
            if module and function:
                out.append(Named(key, module, function))
    train = job.get("train") if isinstance(job, Mapping) else None
    metrics = train.get("metrics") if isinstance(train, Mapping) else None
    for name in metrics if isinstance(metrics, list | tuple) else ():  # train.metrics' functions
        if isinstance(name, str) and name.count(":") == 1 and all(name.split(":")):
            out.append(Named("train.metrics", *name.split(":")))
    return out


# "package.module:function", as a job names its user code
FUNCTION = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class FunctionError(ValueError):
    """A named function cannot be had; ``str(e)`` is one line naming it and why (the caller
    raises it again as its own kind of error, with the job key it belongs to)."""


def load_function(name: Any, what: str) -> Callable[..., Any]:
    """The callable ``"package.module:function"`` stands for, imported as the module is now
    (:func:`check_user_code` makes it current first). ``what`` begins each error's line:
    ``"model"``, ``"loss"``, ``"data"``, ``"data.collate"``."""
    if not isinstance(name, str):
        raise FunctionError(f"{what} name must be a string, got {name!r}")
    if not FUNCTION.fullmatch(name):
        raise FunctionError(f"{what} '{name}': expected 'package.module:function'")
    module_name, func_name = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        said = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise FunctionError(f"{what} '{name}': cannot import {module_name}: {said}") from None
    func = getattr(module, func_name, None)
    if func is None:
        raise FunctionError(f"{what} '{name}': module {module_name} has no {func_name}")
    if not callable(func):
        raise FunctionError(f"{what} '{name}': {func_name} is not callable")
    return func


def digest(source: bytes) -> str:
    """The content hash of a module's source: sha256, hex."""
    return hashlib.sha256(source).hexdigest()


def check_user_code(job: Any, host: str | None = None) -> dict[str, str]:
    """Make every user module ``job`` names current on this host; return each one's hash.

    Compares this host's source with the hash the job carries (its ``code`` table), re-imports
    a module whose file changed since it was imported here, and checks that the named function
    exists. ``host`` names this process in messages (``"head"``); None leaves that to the
    caller (a worker prefixes its device). Raises :class:`UserCodeError`. A module without a
    source file (an extension module) is imported as usual, and has no hash to compare.
    """
    wanted = _wanted(job)
    shipped = _table(job, "sources")
    got: dict[str, str] = {}
    with _LOCK:
        for named in named_code(job):
            source = shipped.get(named.module)
            if source is not None:
                module, have = _shipped(named, host, source.encode(), wanted.get(named.module))
            else:
                module, have = _current(named, host, wanted.get(named.module))
            if have is not None:
                got[named.module] = have
            if not hasattr(module, named.function):
                raise UserCodeError(
                    named.key,
                    f"{_prefix(host)}module {named.module!r} ({_where(module)}) has no "
                    f"{named.function}",
                )
    return got


def _wanted(job: Any) -> Mapping[str, str]:
    return _table(job, "code")


def _table(job: Any, key: str) -> Mapping[str, str]:
    """The job's ``code`` or ``sources`` table (a ``JobSpec`` or a job dict)."""
    table = getattr(job, key, None)
    if table is None and isinstance(job, Mapping):
        table = job.get(key)
    return table if isinstance(table, Mapping) else {}


def ship_sources(spec: Any) -> dict[str, str]:
    """The source of each user module ``spec`` names, as this host has it, to ship with the
    job (``[security] ship_code``); the job's ``code`` must then hold these bytes' hashes
    (:func:`check_user_code` on this host, just before, returns them)."""
    out: dict[str, str] = {}
    for named in named_code(spec):
        found = _find_spec(named.module)
        origin = found.origin if found is not None else None
        if origin and origin.endswith(".py") and os.path.isfile(origin):
            with open(origin, "rb") as f:
                out[named.module] = f.read().decode()
    return out


def _cache_dir() -> str:
    """Where this host writes shipped modules (content-addressed, per user), so tracebacks
    and ``inspect`` find a file with the very bytes that run."""
    return os.path.join(tempfile.gettempdir(), f"hetpipe-code-{os.getuid()}")


def _shipped(
    named: Named, host: str | None, source: bytes, want: str | None
) -> tuple[ModuleType, str]:
    """The module run from the source the job shipped (never this host's own copy)."""
    name = named.module
    have = digest(source)
    if want is not None and have != want:  # the job parser refuses this before; kept cheap
        raise UserCodeError(
            named.key,
            f"{_prefix(host)}the shipped source of module {name!r} has sha256 {have[:SHOWN]}, "
            f"the job was submitted with {want[:SHOWN]}",
        )
    loaded = _LOADED.get(name)
    if loaded is not None and loaded[0] == have and sys.modules.get(name) is loaded[1]:
        return loaded[1], have
    folder = os.path.join(_cache_dir(), have)
    origin = os.path.join(folder, *name.split(".")) + ".py"
    try:
        if not os.path.isfile(origin):
            os.makedirs(os.path.dirname(origin), mode=0o700, exist_ok=True)
            tmp = f"{origin}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(source)
            os.replace(tmp, origin)
        parent = name.rpartition(".")[0]
        if parent:
            importlib.import_module(parent)  # the package itself must be installed here
        module = _execute(name, None, origin, source)
    except Exception as exc:
        raise _failure(named, host, exc, f"{origin} (shipped with the job)") from None
    _LOADED[name] = (have, module)
    return module, have


def _prefix(host: str | None) -> str:
    return f"{host}: " if host else ""


def _where(module: ModuleType) -> str:
    return str(getattr(module, "__file__", None) or "no file")


def _current(named: Named, host: str | None, want: str | None) -> tuple[ModuleType, str | None]:
    """The module, current with its file here, and the hash of the source it runs."""
    name = named.module
    importlib.invalidate_caches()  # a file added since the last import is found
    try:
        spec = _find_spec(name)
    except Exception as exc:  # a package above it failed to import
        raise _failure(named, host, exc) from None
    if spec is None:
        raise _failure(named, host, ModuleNotFoundError(f"No module named {name!r}"))
    origin = spec.origin
    if not (spec.has_location and origin and origin.endswith(".py") and os.path.isfile(origin)):
        if want is not None:
            raise UserCodeError(
                named.key,
                f"{_prefix(host)}module {name!r} ({origin or 'no file'}) has no source "
                f"file to compare with the submitted hash {want[:SHOWN]}",
            )
        try:
            return importlib.import_module(name), None
        except Exception as exc:
            raise _failure(named, host, exc, origin) from None
    try:
        with open(origin, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise _failure(named, host, exc, origin) from None
    have = digest(source)
    if want is not None and have != want:
        raise UserCodeError(
            named.key,
            f"{_prefix(host)}{origin}: this host's copy of module {name!r} has sha256 "
            f"{have[:SHOWN]}, the job was submitted with {want[:SHOWN]}: put the same file on "
            f"every host (or submit from the copy the cluster has)",
        )
    loaded = _LOADED.get(name)
    if loaded is not None and loaded[0] == have and sys.modules.get(name) is loaded[1]:
        return loaded[1], have
    if loaded is None and _unchanged_since_imported(name, origin):
        _LOADED[name] = (have, sys.modules[name])
        return sys.modules[name], have
    try:
        module = _execute(name, spec, origin, source)
    except Exception as exc:
        raise _failure(named, host, exc, origin) from None
    _LOADED[name] = (have, module)
    return module, have


def _unchanged_since_imported(name: str, origin: str) -> bool:
    """Whether a module imported here by a plain ``import`` (not by :func:`check_user_code`)
    surely runs its file as it is now: hetpipe's own modules (the daemon's code: running
    them again would make new copies of its classes; a changed hetpipe needs a restart), or
    a file last written before this process started to check code. Otherwise it is run
    again, once."""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if module is None or not file or os.path.realpath(file) != os.path.realpath(origin):
        return False
    if name == "hetpipe" or name.startswith("hetpipe."):
        return True
    try:
        return os.stat(origin).st_mtime < _STARTED
    except OSError:
        return False


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where an import of ``name`` would load it from now, without executing it: the import
    system's finders asked afresh (``importlib.util.find_spec`` answers a module already
    imported with the spec it was imported by, which is not where a new import would look)."""
    parent, _, _ = name.rpartition(".")
    path = None
    if parent:
        path = getattr(importlib.import_module(parent), "__path__", None)
        if path is None:
            raise ModuleNotFoundError(f"{parent!r} is not a package")
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path)
        if spec is not None:
            return spec
    return None


class _ExactLoader(importlib.machinery.SourceFileLoader):
    """Compiles the bytes it is given, never a cached ``.pyc``: a file edited within the
    same second at the same size would otherwise load its old bytecode, and the code run is
    exactly the code whose hash was checked."""

    def __init__(self, name: str, path: str, source: bytes) -> None:
        super().__init__(name, path)
        self.source = source

    def get_data(self, path: str) -> bytes:
        return self.source if path == self.path else super().get_data(path)

    def get_code(self, fullname: str) -> Any:
        return self.source_to_code(self.source, self.path)


def _execute(
    name: str, found: importlib.machinery.ModuleSpec | None, origin: str, source: bytes
) -> ModuleType:
    """Execute ``source`` as module ``name`` and put it in ``sys.modules`` (and on its
    parent package); on failure the module imported before stays. ``found``: where an
    import found it (None: a shipped module, never a package)."""
    loader = _ExactLoader(name, origin, source)
    search = found.submodule_search_locations if found is not None else None
    spec = importlib.util.spec_from_file_location(
        name, origin, loader=loader, submodule_search_locations=search
    )
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    before = sys.modules.get(name)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        if before is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before
        raise
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _failure(
    named: Named, host: str | None, exc: BaseException, origin: str | None = None
) -> UserCodeError:
    """The one line of an import failure: which module, why, and where this host looked."""
    why = " ".join(f"{type(exc).__name__}: {exc}".split())
    if origin is not None:
        where = f"from {origin}"
        hint = "fix the file"
    else:
        where = f"looked in {_search_path()}"
        hint = (
            "a job's own module must be on the PYTHONPATH of the head and of every worker "
            "before `hetpipe up`"
        )
    return UserCodeError(
        named.key,
        f"{_prefix(host)}cannot import module {named.module!r} ({why}); {where}: {hint}",
    )


def _search_path() -> str:
    """This process's ``sys.path``, briefly: the entries outside the Python installation
    (the user's folders), then the installation as one item."""
    install = {
        os.path.realpath(p)
        for p in (sys.prefix, sys.base_prefix, *sysconfig.get_paths().values())
        if p
    }
    mine: list[str] = []
    for entry in sys.path:
        real = os.path.realpath(entry or os.getcwd())
        path = os.path.abspath(entry or os.getcwd())
        if any(real == p or real.startswith(p + os.sep) for p in install) or path in mine:
            continue
        mine.append(path)
    shown = mine[:_PATHS_SHOWN]
    if len(mine) > len(shown):
        shown.append(f"{len(mine) - len(shown)} more")
    return ", ".join([*shown, "the Python installation"])
