"""The portal's submit form (``/jobs/new``): the files and settings of ``vsdk submit``.

The form's files are packed exactly as ``vsdk submit`` packs them (``vpool.bundle.pack``),
stored as blobs and submitted through ``Coordinator.submit``, so the checks and their messages
are the same; each error is shown next to the field that caused it and nothing is kept from a
refused form but what the user typed.

"When a rank is lost" (``on_failure``) is the choice of ``vsdk submit --on-failure``. It
replaced the fault tolerance checkbox; a post without it that sends ``fault_tolerance`` as the
old form did still means what it meant (ticked: "transparent", left out: "abort").
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.datastructures import FormData, UploadFile

from vpool import bundle, requirements
from vpool.coordinator.access import Principal
from vpool.coordinator.errors import BadRequest, CoordinatorError, TooLarge
from vpool.coordinator.service import Coordinator
from vpool.coordinator.transport import coordinator
from vpool.coordinator.transport import form as read_form
from vpool.protocol import api
from vpool.sizes import parse_size
from vpool.web import session
from vpool.web.render import page
from vpool.web.session import Viewer, viewer

router = APIRouter()

MAX_INPUTS = 100
MAX_ARGS_TEXT = 64 << 10
# Which field an error of ``Coordinator.submit`` belongs to, by its code.
FIELD_OF_CODE = {
    "bad_ranks": "ranks",
    "bad_checkpoint_every": "checkpoint_every",
    "bad_memory": "memory",
    "bad_bundle": "program",
    "not_python": "program",
    "too_large": "program",
    "bad_requirements": "requirements",
    "bad_validate": "validate",
}
# The choices of "When a rank is lost" (``api.FAILURE_MODES``): what it is, and what it means.
ON_FAILURE_CHOICES: dict[str, tuple[str, str]] = {
    "transparent": (
        "Restart it elsewhere",
        "the program never notices: the rank replays its logged messages, the output stays "
        "the same",
    ),
    "abort": (
        "Fail the job",
        "no message logging (a little faster); the job fails at the first lost rank",
    ),
    "ulfm": (
        "Tell the other ranks (ULFM)",
        "for programs that handle failures themselves: the rank is declared failed, the others "
        "get MPI.ERR_PROC_FAILED (Comm.Revoke/Agree/Shrink) and the job succeeds if they exit 0",
    ),
    # FT-MPI's modes: reported as in "ulfm"; the others recover with MPI.COMM_WORLD.Dup().
    "blank": (
        "Leave a hole (FT-MPI blank)",
        "as ULFM, but the others recover with MPI.COMM_WORLD.Dup(): the world keeps its size "
        "and their ranks, with a hole where the lost rank was",
    ),
    "shrink": (
        "Shrink the world (FT-MPI shrink)",
        "as ULFM, but the others recover with MPI.COMM_WORLD.Dup(): the lost rank is removed, "
        "they are renumbered in order and the world is smaller",
    ),
    "rebuild": (
        "Start a new rank in its place (FT-MPI rebuild)",
        "as ULFM, but the others recover with MPI.COMM_WORLD.Dup(): a new process of the "
        "program (a spawned one) takes the lost rank's number and joins them",
    ),
}
RESTART = ON_FAILURE_CHOICES["transparent"][0]
MODES: dict[str, api.FailureMode] = {mode: mode for mode in api.FAILURE_MODES}


@dataclass
class Draft:
    """What the user typed, to show again with the errors."""

    name: str = ""
    ranks: str = "4"
    args: str = ""
    entry: str = ""
    checkpoint_every: str = ""
    memory: str = ""
    on_failure: str = "transparent"
    unsandboxed: bool = False
    validate: bool = False
    requirements: str = ""
    errors: dict[str, str] = field(default_factory=dict)

    def error(self, name: str, message: str) -> None:
        self.errors.setdefault(name, message)


@router.get("/jobs/new", response_class=HTMLResponse)
async def new_job(request: Request) -> Response:
    v = await viewer(request)
    return _form(request, v, Draft())


def _form(request: Request, v: Viewer, draft: Draft, status: int = 200) -> Response:
    core = coordinator(request)
    return page(
        request,
        v,
        "new_job.html",
        status=status,
        draft=draft,
        max_ranks=core.settings.max_ranks,
        min_checkpoint=core.settings.min_checkpoint_every,
        validate_jobs=core.settings.validate_jobs,
        on_failure_choices=ON_FAILURE_CHOICES,
    )


@router.post("/jobs/new", response_class=HTMLResponse)
async def submit(request: Request) -> Response:
    v = await viewer(request)
    core = coordinator(request)
    length = request.headers.get("content-length", "")
    if not (length.isascii() and length.isdigit()):  # isdigit() alone takes '²' too
        raise BadRequest("a form upload must say its length", code="length_required")
    if int(length) > core.settings.max_blob_bytes:
        raise TooLarge(f"the upload is larger than {core.settings.max_blob_bytes} bytes")
    form = await read_form(request, max_files=MAX_INPUTS + 2, max_fields=40)
    try:
        session.check_post(request, form, v.csrf)
        draft = _draft(form)
        try:
            # Its uploads count against the user's quota (409 quota_exceeded) like vsdk's.
            sub = await _submission(core, v.who, form, draft)
            if sub is None:
                return _form(request, v, draft, status=422)
            job = await core.submit(v.who, sub)
        except CoordinatorError as exc:
            draft.error(_field(exc), exc.message)
            return _form(request, v, draft, status=exc.status)
    finally:
        await form.close()
    return RedirectResponse(f"/jobs/{job.id}", 303)


def _text(form: FormData, name: str, limit: int = 4096) -> str:
    value = form.get(name)
    return value[:limit] if isinstance(value, str) else ""


def _files(form: FormData, name: str) -> list[UploadFile]:
    """The files of a file field; a field left empty sends one nameless empty part."""
    return [f for f in form.getlist(name) if isinstance(f, UploadFile) and f.filename]


def _draft(form: FormData) -> Draft:
    draft = Draft(
        name=_text(form, "name"),
        ranks=_text(form, "ranks"),
        args=_text(form, "args", MAX_ARGS_TEXT),
        entry=_text(form, "entry"),
        checkpoint_every=_text(form, "checkpoint_every"),
        memory=_text(form, "memory"),
        requirements=_text(form, "requirements", MAX_ARGS_TEXT),
    )
    draft.on_failure = _on_failure(form, draft)
    draft.unsandboxed = _checkbox(form, draft, "unsandboxed")
    draft.validate = _checkbox(form, draft, "validate")
    return draft


def _on_failure(form: FormData, draft: Draft) -> str:
    """The one value of the "When a rank is lost" choice. A post without it (as the form sent
    before the choice) says it with the fault tolerance checkbox: ticked is "transparent", left
    out "abort"."""
    values = form.getlist("on_failure")
    if not values:
        return "transparent" if _checkbox(form, draft, "fault_tolerance") else "abort"
    _checkbox(form, draft, "fault_tolerance")  # a hostile value is an error all the same
    value = values[0]
    if len(values) == 1 and isinstance(value, str) and value in MODES:
        return value
    *others, last = (f'"{label}"' for label, _ in ON_FAILURE_CHOICES.values())
    draft.error("on_failure", f"choose one: {', '.join(others)} or {last}")
    return ""  # no choice shown as made


def _checkbox(form: FormData, draft: Draft, name: str) -> bool:
    """A checkbox sends "on" when ticked and nothing otherwise (an empty value counts as
    nothing); any other value, or a file, did not come from the form and is an error of the
    field rather than a guess."""
    values = form.getlist(name)
    if all(v == "" for v in values):
        return False
    if all(v == "on" for v in values):
        return True
    draft.error(name, "not a value this checkbox sends: tick it or leave it out")
    return False


async def _submission(
    core: Coordinator, who: Principal, form: FormData, draft: Draft
) -> api.JobSubmit | None:
    """The job the form asks for, its blobs stored; None (and ``draft.errors``) if wrong."""
    ranks = _number(draft, "ranks", draft.ranks, int, "a whole number of ranks")
    every = 0.0
    if draft.checkpoint_every.strip():
        every = _number(draft, "checkpoint_every", draft.checkpoint_every, float, "seconds")
    if draft.on_failure not in ("transparent", ""):
        # Checkpoints and validation need the message logs only "transparent" keeps: said here
        # in the form's words, rather than the coordinator's (which name the API's fields).
        if every > 0:
            draft.error(
                "checkpoint_every",
                f'checkpoints are for restarting lost ranks: choose "{RESTART}" when '
                "a rank is lost, or leave this empty",
            )
        if draft.validate:
            draft.error(
                "validate",
                "validation replays the messages logged only to restart lost ranks: choose "
                f'"{RESTART}" when a rank is lost, or untick this',
            )
        elif core.settings.validate_jobs:
            draft.error(
                "on_failure",
                "this pool validates every job, which replays the messages logged only to "
                f'restart lost ranks: choose "{RESTART}"',
            )
    memory = 0
    if draft.memory.strip():
        try:
            memory = parse_size(draft.memory)
        except ValueError as exc:
            draft.error("memory", str(exc))
    try:
        args = shlex.split(draft.args)
    except ValueError as exc:
        draft.error("args", f"cannot split the arguments as a shell would: {exc}")
        args = []

    programs, inputs = _files(form, "program"), _files(form, "inputs")
    project, stdins = _files(form, "project"), _files(form, "stdin")
    if len(programs) + bool(project) != 1:
        draft.error("program", "choose the program: one .py file or a .zip, or a project folder")
    elif programs and not (programs[0].filename or "").endswith((".py", ".zip")):
        draft.error("program", f"{programs[0].filename} is neither a .py file nor a .zip")
    if len(inputs) > MAX_INPUTS:
        draft.error("inputs", f"at most {MAX_INPUTS} input files")
    if len(project) > bundle.MAX_FILES:
        draft.error("program", f"the project folder has more than {bundle.MAX_FILES} files")
    if draft.errors:
        return None

    try:
        needs = requirements.parse_lines(draft.requirements, "the requirements")
    except requirements.RequirementsError as exc:
        draft.error("requirements", str(exc))
        return None
    files = [(f.filename or "", await f.read()) for f in inputs]
    entry = draft.entry.strip() or None
    try:
        if project:
            name, tree = await _tree(project)
            packed = bundle.pack_tree(tree, entry or "__main__.py", files)
            if "pyproject.toml" in tree:
                declared = requirements.from_pyproject(
                    tree["pyproject.toml"].decode(errors="replace"), f"{name}/pyproject.toml"
                )
                needs = requirements.normalize([*needs, *declared])
        else:
            name = programs[0].filename or ""
            packed = bundle.pack(name, await programs[0].read(), files, entry=entry)
    except bundle.BundleError as exc:
        draft.error(exc.field, exc.message)
        return None
    except requirements.RequirementsError as exc:
        draft.error("requirements", str(exc))
        return None
    bundle_sha = await _store(core, who, packed.data)
    stdin_sha = await _store(core, who, await stdins[0].read()) if stdins else None
    return api.JobSubmit(
        ranks=ranks,
        bundle=bundle_sha,
        entry=packed.entry,
        args=args,
        stdin=stdin_sha,
        name=draft.name.strip() or name,
        fault_tolerance=draft.on_failure == "transparent",
        on_failure=MODES[draft.on_failure],
        checkpoint_every=every,
        memory=memory,
        unsandboxed=draft.unsandboxed,
        requirements=needs,
        validate=draft.validate,
    )


N = TypeVar("N", int, float)


async def _tree(uploads: list[UploadFile]) -> tuple[str, dict[str, bytes]]:
    """A folder upload (``webkitdirectory``: each file named by its path under the folder
    chosen, that folder first): the folder's name, and its files by path inside it."""
    paths = [PurePosixPath(f.filename or "") for f in uploads]
    tops = {p.parts[0] for p in paths if len(p.parts) > 1}
    strip = len(tops) == 1 and all(len(p.parts) > 1 for p in paths)
    name = tops.pop() if strip else "project"
    rels = [PurePosixPath(*p.parts[1:]) if strip else p for p in paths]
    venvs = {r.parent for r in rels if r.name == "pyvenv.cfg"}  # virtual environments
    tree = {}
    for rel, upload in zip(rels, uploads, strict=True):
        dirs = rel.parents
        if any(part in bundle.SKIPPED_DIRS for part in rel.parts[:-1]) or venvs & set(dirs):
            continue
        if rel.suffix in (".pyc", ".pyo"):
            continue
        tree[str(rel)] = await upload.read()
    return name, tree


def _number(draft: Draft, name: str, text: str, kind: type[N], what: str) -> N:
    try:
        return kind(text.strip())
    except ValueError:
        draft.error(name, f"{text.strip() or 'nothing'} is not {what}")
        return kind(0)


async def _store(core: Coordinator, who: Principal, data: bytes) -> str:
    async def chunks() -> AsyncIterator[bytes]:
        yield data

    info = await core.put_blob(who, hashlib.sha256(data).hexdigest(), chunks())
    return info.sha256


def _field(exc: CoordinatorError) -> str:
    if exc.code in FIELD_OF_CODE:
        if exc.code == "bad_bundle" and "entry" in exc.message:
            return "entry"
        return FIELD_OF_CODE[exc.code]
    if "name" in exc.message:
        return "name"
    return "form"
