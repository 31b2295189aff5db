"""What the trigger DAGs decide: which recipes, which commits, which run ids.

`speed_matrix_nightly` and `vllm_commit_watch` are thin; everything they decide is here, as
plain functions over plain data, so it is tested without Airflow and reused by both DAGs.

"Never twice for one commit" rests on two layers:

1. Deterministic run ids (`commit__<recipe>__<sha>`, `nightly__<recipe>__<YYYY-MM-DD>`):
   Airflow keeps (dag_id, run_id) unique in its metadata DB, so a second trigger of the same
   commit (a racing poll, a retried task, a lost watermark) is refused by the database and the
   trigger task is marked skipped (`skip_when_already_exists`). This holds across restarts,
   workers and concurrent polls; an Airflow Variable alone would not (read-modify-write).
2. A durable watermark (an Airflow Variable holding the newest handled commit and the ETag of
   the answer it came from): it says which commits are *new*, so the watch does not re-plan
   history and can ask GitHub "anything since?" with If-None-Match. It is advanced only after
   the triggers succeeded; if two polls race and one writes an older watermark, the next poll
   re-plans a few commits whose run ids already exist, and nothing is triggered twice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal

import requests

from speedmatrix.recipes import RecipeError, list_recipe_ids, load_recipe, wheel_index_for
from speedmatrix.upstream import wheels
from speedmatrix.upstream.github import (
    Commit,
    CommitPage,
    GitHubClient,
    GitHubError,
    GitHubUnavailable,
)
from speedmatrix.upstream.schedule import GitHubConfig, load_schedule_config

log = logging.getLogger("speedmatrix.triggers")

TARGET_DAG_ID = "speed_matrix"
STATE_VARIABLE = "speedmatrix_vllm_commit_watch"
# Airflow's default [scheduler] allowed_run_id_pattern.
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.~:+-]+$")
MAX_SKIPPED_KEPT = 500

ScheduleKind = Literal["nightly", "per_commit"]


# ---------------------------------------------------------------------------------------------
# Recipes and run ids


@dataclass(frozen=True)
class ScheduledRecipe:
    """The little the triggers need from a recipe."""

    id: str
    host: str = "local"
    wheel_index: str | None = None  # set only for install kind "wheel"
    variant: str | None = None


def scheduled_recipes(kind: ScheduleKind) -> list[ScheduledRecipe]:
    """Recipes whose `schedule.<kind>` is true, sorted by id.

    A recipe that does not load is logged and left out: one broken file must not stop the
    nightly run of every other recipe (and `speedmatrix recipes validate` names it).
    """
    out: list[ScheduledRecipe] = []
    for rid in list_recipe_ids():
        try:
            recipe = load_recipe(rid)
        except RecipeError as exc:
            log.error("recipe %s does not load, not scheduled: %s", rid, exc)
            continue
        if not getattr(recipe.schedule, kind):
            continue
        install = recipe.engine.install
        out.append(
            ScheduledRecipe(
                id=recipe.id,
                host=recipe.schedule.host,
                wheel_index=wheel_index_for(recipe) if install.kind == "wheel" else None,
                variant=recipe.engine.variant,
            )
        )
    return out


def _run_id_part(recipe_id: str) -> str:
    """A recipe id inside a run id: '/' is not allowed there, '~' is (and not used in ids)."""
    part = recipe_id.replace("/", "~")
    if not RUN_ID_RE.match(part):
        raise ValueError(f"recipe id {recipe_id!r} cannot be part of an Airflow run id")
    return part


def commit_run_id(recipe_id: str, sha: str) -> str:
    """`commit__<recipe>__<sha>`: the one run of `recipe_id` for commit `sha`."""
    return f"commit__{_run_id_part(recipe_id)}__{sha}"


def nightly_run_id(recipe_id: str, night: date) -> str:
    """`nightly__<recipe>__<YYYY-MM-DD>`: the one nightly run of `recipe_id` for `night`."""
    return f"nightly__{_run_id_part(recipe_id)}__{night.isoformat()}"


def _trigger(run_id: str, recipe: ScheduledRecipe, sha: str, run_after: datetime) -> dict:
    """One element of the mapped TriggerDagRunOperator's expand_kwargs."""
    return {
        "trigger_run_id": run_id,
        "conf": {"recipe": recipe.id, "engine_ref": sha, "ssh_conn_id": recipe.host},
        # run_after orders the queued runs: the scheduler starts queued runs by run_after.
        "run_after": run_after.isoformat(),
    }


def plan_nightly_triggers(
    recipes: Sequence[ScheduledRecipe], sha: str, night: date, now: datetime
) -> list[dict]:
    """One trigger per nightly recipe at `sha`; run ids fixed by the night, not the commit."""
    return [
        _trigger(nightly_run_id(r.id, night), r, sha, now + timedelta(milliseconds=i))
        for i, r in enumerate(recipes)
    ]


# ---------------------------------------------------------------------------------------------
# The commit watch


@dataclass
class WatchState:
    """What survives between polls (stored as JSON in the Airflow Variable STATE_VARIABLE)."""

    sha: str | None = None  # newest commit handled (triggered or skipped for good)
    etag: str | None = None  # ETag of the /commits answer whose head is `sha`
    skipped: list[dict] = field(default_factory=list)  # newest last, bounded
    updated_at: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> WatchState:
        if not isinstance(data, dict):
            return cls()
        return cls(
            sha=data.get("sha"),
            etag=data.get("etag"),
            skipped=list(data.get("skipped") or []),
            updated_at=data.get("updated_at"),
        )

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class CommitPlan:
    """One poll's decision; `to_json()` is what the poll task returns."""

    status: Literal["ok", "not_modified", "no_recipes"]
    triggers: list[dict] = field(default_factory=list)
    commits: list[str] = field(default_factory=list)  # triggered, oldest first
    skipped: list[dict] = field(default_factory=list)  # {sha, title, reason}
    pending: list[str] = field(default_factory=list)  # waiting for a wheel, retried next poll
    notes: list[str] = field(default_factory=list)
    state: dict | None = None  # the state to store after the triggers; None: leave as is

    def to_json(self) -> dict:
        return asdict(self)


WheelCheck = Callable[[ScheduledRecipe, str], bool]


def _commit_time(commit: Commit) -> datetime | None:
    if not commit.date:
        return None
    try:
        return datetime.fromisoformat(commit.date.replace("Z", "+00:00"))
    except ValueError:
        return None


def _age_s(commit: Commit, now: datetime) -> float | None:
    when = _commit_time(commit)
    return None if when is None else (now - when).total_seconds()


def _run_afters(commits: Sequence[Commit], per_commit: int, now: datetime) -> list[datetime]:
    """Strictly increasing run_after values, `per_commit` per commit, oldest commit first.

    Derived from the commits' own dates (capped at `now`), not from the poll's clock, so two
    racing polls planning the same commits give each trigger the same run_after and the
    queued runs start oldest commit first whichever poll won each trigger.
    """
    out: list[datetime] = []
    for c in commits:
        base = min(_commit_time(c) or now, now)
        for _ in range(per_commit):
            t = base if not out else max(base, out[-1] + timedelta(milliseconds=1))
            out.append(t)
    return out


def plan_commit_triggers(
    page: CommitPage,
    state: WatchState,
    recipes: Sequence[ScheduledRecipe],
    *,
    cap: int,
    now: datetime,
    wheel_ready: WheelCheck | None = None,
    wheel_max_wait_s: float = 21600,
) -> CommitPlan:
    """Decide which new commits of `page` to trigger, oldest first.

    - New commits are those newer than `state.sha` in the page (newest first). With no state
      yet, only the head is new: a fresh deployment starts from now, not from history.
    - Cap: at most `cap` commits per poll; the newest win (a benchmark of today's main beats
      one of last week's), the older ones are skipped for good and recorded with the reason.
    - Wheels (`wheel_ready` given): commits are taken oldest first until one whose wheel is
      not published yet; it and the newer ones stay pending for the next poll (so the order
      holds), unless it is older than `wheel_max_wait_s`, then it is skipped and recorded.
    - The watermark moves to the newest commit all of whose predecessors are handled; the
      ETag is kept only when that is the page's head (else a 304 would hide pending commits).
    """
    if page.not_modified:
        return CommitPlan(status="not_modified")
    if not recipes:
        return CommitPlan(status="no_recipes", notes=["no recipe has schedule.per_commit"])
    commits = page.commits
    if not commits:
        return CommitPlan(status="ok", notes=["the branch has no commits"])

    notes: list[str] = []
    shas = [c.sha for c in commits]
    if state.sha is None:
        new = [commits[0]]
        notes.append(f"no watermark yet: starting from the head {commits[0].sha[:12]}")
    elif state.sha in shas:
        new = commits[: shas.index(state.sha)]
    else:
        new = list(commits)
        notes.append(
            f"watermark {state.sha[:12]} is not among the newest {len(commits)} commits "
            "(a long gap or a force-push): older commits were not examined"
        )
    new.reverse()  # oldest first

    skipped: list[dict] = []
    if len(new) > cap:
        for c in new[:-cap]:
            skipped.append({"sha": c.sha, "title": c.title, "reason": f"cap of {cap} per poll"})
        new = new[-cap:]

    ready: list[Commit] = []
    pending: list[Commit] = []
    for i, c in enumerate(new):
        wheel_recipes = [r for r in recipes if r.wheel_index]
        if wheel_ready is None or all(wheel_ready(r, c.sha) for r in wheel_recipes):
            ready.append(c)
            continue
        age = _age_s(c, now)
        if age is not None and age > wheel_max_wait_s:
            skipped.append(
                {"sha": c.sha, "title": c.title, "reason": f"no wheel after {age / 3600:.1f} h"}
            )
            continue
        pending = new[i:]
        break

    triggers: list[dict] = []
    run_afters = iter(_run_afters(ready, len(recipes), now))
    for c in ready:
        for r in recipes:
            triggers.append(_trigger(commit_run_id(r.id, c.sha), r, c.sha, next(run_afters)))

    handled = [c.sha for c in new if c not in pending]
    if pending:
        # newest handled commit below the first pending one; else the watermark stays
        first_pending = shas.index(pending[0].sha)
        older_handled = [s for s in shas[first_pending + 1 :] if s in handled]
        watermark = older_handled[0] if older_handled else state.sha
        etag = None
    else:
        watermark, etag = commits[0].sha, page.etag
    kept = (state.skipped + skipped)[-MAX_SKIPPED_KEPT:]
    new_state = WatchState(sha=watermark, etag=etag, skipped=kept, updated_at=now.isoformat())
    changed = (watermark, etag, len(skipped)) != (state.sha, state.etag, 0)
    return CommitPlan(
        status="ok",
        triggers=triggers,
        commits=[c.sha for c in ready],
        skipped=skipped,
        pending=[c.sha for c in pending],
        notes=notes,
        state=new_state.to_json() if changed else None,
    )


def wheel_url(template: str | None, recipe: ScheduledRecipe, sha: str) -> str:
    """The index page that lists `sha`'s wheels: by default the one provisioning installs from
    (`<wheel_index>/<sha>[/<variant>]/vllm/`); a deployment's template for another layout."""
    if template is None:
        return wheels.page_url(wheels.index_url(recipe.wheel_index or "", sha, recipe.variant))
    return template.format(
        wheel_index=(recipe.wheel_index or "").rstrip("/"), sha=sha, variant=recipe.variant or ""
    )


def make_wheel_check(
    template: str | None, timeout_s: float = 10, session: requests.Session | None = None
) -> WheelCheck:
    """A WheelCheck with provisioning's rule (upstream.wheels): the page lists a vLLM wheel."""
    http = session or requests.Session()

    def ready(recipe: ScheduledRecipe, sha: str) -> bool:
        return wheels.is_published(wheel_url(template, recipe, sha), timeout_s, http)

    return ready


# ---------------------------------------------------------------------------------------------
# Airflow glue (imported lazily so the rest stays usable and testable without Airflow)


def github_token(conn_id: str | None) -> str | None:
    """The token in Airflow connection `conn_id` (its password), or None when absent."""
    if not conn_id:
        return None
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        conn = Connection.get(conn_id)
    except AirflowNotFoundException:
        log.info("no Airflow connection %r: calling GitHub without a token", conn_id)
        return None
    return conn.password or None


def refuse_conf_api_url(params: dict[str, Any]) -> None:
    """Fail a run whose conf names a GitHub API (a key a conf must not set): whoever may
    trigger a DAG must not receive the token or pick the commits."""
    if params.get("api_url") is not None:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(
            "api_url is not taken from a conf: the GitHub API is the deployment's "
            "(SPEEDMATRIX_GITHUB_API_URL, or github.api_url in the schedule config)"
        )


def github_client(cfg: GitHubConfig) -> GitHubClient:
    """A client for the configured API, with the connection's token if any (sent to that
    API's origin only: `github.OriginToken`)."""
    return GitHubClient(
        base_url=cfg.api_url,
        token=github_token(cfg.conn_id),
        timeout_s=cfg.timeout_s,
        retries=cfg.retries,
    )


def night_of(logical_date: datetime | None, run_after: datetime | None) -> date:
    """The UTC date a nightly run belongs to (manual runs may have no logical date)."""
    when = logical_date or run_after
    if when is None:
        raise ValueError("a nightly run needs a logical date or a run_after")
    if when.tzinfo is not None:
        when = when.astimezone(UTC)
    return when.date()


def log_plan(plan: CommitPlan | dict, logger: logging.Logger = log) -> None:
    """One readable summary of a poll for the task log."""
    p = plan.to_json() if isinstance(plan, CommitPlan) else plan
    logger.info(
        "commit watch: %s; triggering %d run(s) for %d commit(s): %s",
        p["status"],
        len(p["triggers"]),
        len(p["commits"]),
        ", ".join(s[:12] for s in p["commits"]) or "none",
    )
    for s in p["skipped"]:
        logger.warning("skipped commit %s (%s): %s", s["sha"][:12], s.get("title", ""), s["reason"])
    if p["pending"]:
        logger.info("waiting for wheels of: %s", ", ".join(s[:12] for s in p["pending"]))
    for n in p["notes"]:
        logger.info("note: %s", n)


def _now() -> datetime:
    return datetime.now(tz=UTC)


def run_commit_poll(params: dict[str, Any] | None = None) -> dict:
    """The body of vllm_commit_watch's `poll` task; returns CommitPlan.to_json().

    Params (all optional, None = the schedule config): max_commits, wait_for_wheel. An
    api_url in the conf fails the poll (the API is the deployment's: `upstream.schedule.github_api_url`).
    A rate limit, a 5xx or a timeout ends the poll as *skipped* with the reason in the log:
    nothing is triggered and the state is untouched, so the next poll simply tries again.
    Misconfiguration (401, 404, a non-GitHub answer) fails the task, because it needs a human.
    """
    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    params = {k: v for k, v in (params or {}).items() if v is not None}
    refuse_conf_api_url(params)
    cfg = load_schedule_config()
    watch = cfg.commit_watch
    recipes = scheduled_recipes("per_commit")
    log.info("per-commit recipes: %s", ", ".join(r.id for r in recipes) or "none")
    state = WatchState.from_json(Variable.get(STATE_VARIABLE, default=None, deserialize_json=True))
    if not recipes:
        plan = CommitPlan(status="no_recipes", notes=["no recipe has schedule.per_commit"])
        log_plan(plan)
        return plan.to_json()
    client = github_client(cfg.github)
    wait_for_wheel = params.get("wait_for_wheel", watch.wait_for_wheel)
    try:
        page = client.list_commits(cfg.github.repo, cfg.github.branch, etag=state.etag)
        plan = plan_commit_triggers(
            page,
            state,
            recipes,
            cap=int(params.get("max_commits", watch.max_commits_per_poll)),
            now=_now(),
            wheel_ready=make_wheel_check(watch.wheel_url, cfg.github.timeout_s)
            if wait_for_wheel
            else None,
            wheel_max_wait_s=watch.wheel_max_wait_s,
        )
    except GitHubUnavailable as exc:
        log.warning("poll ended without triggering anything: %s", exc)
        raise AirflowSkipException(f"GitHub unavailable, next poll retries: {exc}") from exc
    except GitHubError as exc:  # 401, 404, not GitHub: retrying will not help
        raise AirflowFailException(f"GitHub API misconfigured: {exc}") from exc
    log_plan(plan)
    return plan.to_json()


def save_watch_state(state: dict | None) -> None:
    """The body of vllm_commit_watch's last task: store the watermark once triggers are done."""
    if state is None:
        log.info("watch state unchanged")
        return
    from airflow.sdk import Variable

    Variable.set(STATE_VARIABLE, state, serialize_json=True)
    log.info("watch state: watermark %s, etag %s", state.get("sha"), state.get("etag"))


def run_nightly_resolve(params: dict[str, Any] | None = None) -> str:
    """The body of speed_matrix_nightly's `resolve_head` task: main's head sha, asked once.

    Transient GitHub failures raise (the task's retries try again); misconfiguration fails
    at once without retries. Without a head, nothing is triggered.
    """
    from airflow.sdk.exceptions import AirflowFailException

    params = {k: v for k, v in (params or {}).items() if v is not None}
    refuse_conf_api_url(params)
    cfg = load_schedule_config()
    try:
        head = github_client(cfg.github).head_commit(cfg.github.repo, cfg.github.branch)
    except GitHubUnavailable:
        raise
    except GitHubError as exc:
        raise AirflowFailException(f"GitHub API misconfigured: {exc}") from exc
    log.info("%s@%s is %s (%s)", cfg.github.repo, cfg.github.branch, head.sha, head.title)
    return head.sha


def run_nightly_plan(
    sha: str, logical_date: datetime | None, run_after: datetime | None
) -> list[dict]:
    """The body of speed_matrix_nightly's `plan` task: one trigger per nightly recipe."""
    recipes = scheduled_recipes("nightly")
    night = night_of(logical_date, run_after)
    triggers = plan_nightly_triggers(recipes, sha, night, _now())
    log.info(
        "nightly %s at %s: %s",
        night,
        sha[:12],
        ", ".join(t["trigger_run_id"] for t in triggers) or "no recipes",
    )
    return triggers
