"""FastAPI application: HTML pages, a JSON API under /api/v1, live updates (SSE) and /metrics.

Viewing can be open (private network) or require a view token; every state-changing action needs
the admin token in an ``Authorization: Bearer`` header, checked server side. Without a configured
admin token, state-changing endpoints are disabled: there is no default secret. Authentication never
uses cookies for admin actions, so cross-site forms cannot forge them (no CSRF surface).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, StreamingResponse
from fastapi.templating import Jinja2Templates

from server.dashboard import charts, schemas, services
from server.registry.service import Registry, ReleaseKeyError, TransitionError

log = logging.getLogger("fedforge.dashboard")

VersionId = Annotated[str, PathParam(pattern=r"^[0-9a-f]{32}$", description="32 lowercase hex characters")]
RunId = Annotated[str, PathParam(pattern=r"^run-[0-9A-Za-z_-]{1,60}$")]
TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


PAGE_SIZE = 50  # list endpoints and pages: items per page unless ?limit= says otherwise
MAX_PAGE_SIZE = 1000


def paging(limit: int = Query(default=PAGE_SIZE, ge=1, le=MAX_PAGE_SIZE, description="items per page"),
           offset: int = Query(default=0, ge=0, le=10**9, description="items to skip (newest first)")) -> tuple[int, int]:
    return limit, offset


Paging = Annotated[tuple[int, int], Depends(paging)]


@dataclass
class DashboardSettings:
    registry_dir: Path
    admin_token: str | None = None
    view_token: str | None = None
    stop_run: Any = None  # callable(flwr_run_id) -> None, when the dashboard can reach the SuperLink
    poll_seconds: float = 1.0


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


def create_app(settings: DashboardSettings) -> FastAPI:
    registry = Registry.at(settings.registry_dir)
    public_key = settings.registry_dir / "keys" / "signing.pub"
    app = FastAPI(title="FedForge", version="1", description="Federated learning for visual inspection: rounds, factories, privacy and models.")

    def viewer(request: Request, token: str | None = Query(default=None, max_length=200, description="view token (or Bearer header / cookie)")) -> None:
        if not settings.view_token:
            return
        supplied = token or _bearer(request) or request.cookies.get("fedforge_view")
        if not supplied or not hmac.compare_digest(supplied, settings.view_token):
            raise HTTPException(401, "viewing requires the view token")

    def admin(request: Request) -> None:
        if not settings.admin_token:
            raise HTTPException(403, "admin actions are disabled: start the dashboard with --admin-token (or FEDFORGE_ADMIN_TOKEN)")
        supplied = _bearer(request)
        if not supplied or not hmac.compare_digest(supplied, settings.admin_token):
            raise HTTPException(401, "this action requires the admin token as 'Authorization: Bearer <token>'")

    View = Depends(viewer)
    Admin = Depends(admin)

    def page_headers(request: Request, page: services.Page[Any]) -> dict[str, str]:
        """The total in X-Total-Count and the neighbouring pages in a Link header (RFC 8288)."""
        def relative(offset: int) -> str:  # relative references (RFC 3986): right for every host name the dashboard is reached by
            url = request.url.include_query_params(offset=offset, limit=page.limit)
            return f"{url.path}?{url.query}"

        links = [f'<{relative(o)}>; rel="{rel}"' for rel, o in (("next", page.next_offset), ("prev", page.previous_offset)) if o is not None]
        return {"X-Total-Count": str(page.total), **({"Link": ", ".join(links)} if links else {})}

    list_cache: dict[tuple[Any, ...], tuple[bytes, dict[str, str]]] = {}  # list bodies, valid until the registry's stamp moves

    def listed(request: Request, compute: Callable[[], services.Page[Any]], *key: Any) -> Response:
        """A page as a JSON list body with its headers, served from the cache while the registry has not changed: lists are
        read far more often (every open dashboard, every few seconds) than a federation changes them."""
        cache_key = (request.url.path, registry.stamp(), *key)
        if cache_key not in list_cache:
            if len(list_cache) > 512:
                list_cache.clear()
            page = compute()
            body = json.dumps([item.model_dump(mode="json") for item in page.items], separators=(",", ":")).encode()
            list_cache[cache_key] = (body, page_headers(request, page))
        body, headers = list_cache[cache_key]
        return Response(body, media_type="application/json", headers=headers)

    # JSON API ---------------------------------------------------------------------------------
    @app.get("/api/v1/overview", response_model=schemas.Overview, dependencies=[View])
    def api_overview() -> schemas.Overview:
        return services.overview(registry, bool(settings.admin_token))

    @app.get("/api/v1/runs", response_model=list[schemas.RunOut], dependencies=[View])
    def api_runs(request: Request, paging: Paging) -> Response:
        return listed(request, lambda: services.runs(registry, *paging), *paging)

    @app.get("/api/v1/runs/{run_id}", response_model=schemas.RunDetail, dependencies=[View])
    def api_run(run_id: RunId) -> schemas.RunDetail:
        detail = services.run_detail(registry, run_id)
        if detail is None:
            raise HTTPException(404, f"no run {run_id}")
        return detail

    @app.get("/api/v1/factories", response_model=list[schemas.FactoryOut], dependencies=[View])
    def api_factories(request: Request, paging: Paging) -> Response:
        return listed(request, lambda: services.paged(services.factories(registry), *paging), *paging)

    @app.get("/api/v1/privacy", response_model=list[schemas.PrivacyOut], dependencies=[View])
    def api_privacy(request: Request, paging: Paging,
                    history: Annotated[bool, Query(description="include each factory's spend per round (long: one point per round)")] = False) -> Response:
        return listed(request, lambda: services.paged(services.privacy(registry, history), *paging), *paging, history)

    @app.get("/api/v1/versions", response_model=list[schemas.VersionOut], dependencies=[View])
    def api_versions(request: Request, paging: Paging,
                     status: Annotated[str | None, Query(pattern="^(candidate|approved|revoked)$")] = None) -> Response:
        return listed(request, lambda: services.versions(registry, *paging, status=status), *paging, status)

    @app.get("/api/v1/versions/{version_id}", response_model=schemas.VersionDetail, dependencies=[View])
    def api_version(version_id: VersionId) -> schemas.VersionDetail:
        detail = services.version_detail(registry, version_id, public_key)
        if detail is None:
            raise HTTPException(404, f"no version {version_id}")
        return detail

    def downloader(request: Request, token: str | None = Query(default=None, max_length=200)) -> None:
        if not settings.view_token:
            raise HTTPException(403, "downloads need the view token: start the dashboard with --view-token (or FEDFORGE_VIEW_TOKEN)")
        viewer(request, token)

    @app.get("/api/v1/versions/{version_id}/download", dependencies=[Depends(downloader)], response_class=FileResponse)
    def api_download(version_id: VersionId) -> FileResponse:
        v = registry.get_version(version_id)
        if v is None:
            raise HTTPException(404, f"no version {version_id}")
        if v.status == "revoked":
            raise HTTPException(410, f"version {version_id} is revoked and is not served")
        return FileResponse(registry.artifacts.path_for(v.sha256), filename=f"{v.id}.npz", media_type="application/octet-stream")

    def _act(version_id: str, op: str, body: schemas.ActionIn) -> schemas.VersionOut:
        try:
            v = getattr(registry, op)(version_id, actor=f"dashboard:{body.actor}", note=body.note)
        except KeyError:
            raise HTTPException(404, f"no version {version_id}") from None
        except (TransitionError, ReleaseKeyError) as exc:
            raise HTTPException(409, str(exc)) from None
        log.info("%s %s by dashboard:%s", op, version_id, body.actor)
        return services.version_out(v)

    @app.post("/api/v1/versions/{version_id}/approve", response_model=schemas.VersionOut, dependencies=[Admin])
    def api_approve(version_id: VersionId, body: schemas.ActionIn) -> schemas.VersionOut:
        return _act(version_id, "approve", body)

    @app.post("/api/v1/versions/{version_id}/revoke", response_model=schemas.VersionOut, dependencies=[Admin])
    def api_revoke(version_id: VersionId, body: schemas.ActionIn) -> schemas.VersionOut:
        return _act(version_id, "revoke", body)

    @app.post("/api/v1/versions/{version_id}/rollback", response_model=schemas.VersionOut, dependencies=[Admin])
    def api_rollback(version_id: VersionId, body: schemas.ActionIn) -> schemas.VersionOut:
        return _act(version_id, "rollback", body)

    @app.post("/api/v1/runs/{run_id}/stop", response_model=schemas.RunOut, dependencies=[Admin])
    def api_stop(run_id: RunId, body: schemas.ActionIn) -> schemas.RunOut:
        run = registry.get_run(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id}")
        if run.status != "running":
            raise HTTPException(409, f"run {run_id} is {run.status}")
        if settings.stop_run is None:
            raise HTTPException(409, "this dashboard has no SuperLink connection; stop the run with `flwr stop`")
        settings.stop_run(run.flwr_run_id)
        registry.finish_run(run_id, "stopped", f"stopped from the dashboard by {body.actor}")
        return services.run_detail(registry, run_id)

    @app.get("/api/v1/events", dependencies=[View])
    async def api_events(request: Request) -> StreamingResponse:
        """Server-Sent Events: an ``update`` event whenever runs, rounds, versions or actions change."""
        async def stream():  # type: ignore[no-untyped-def]
            last = None
            ticks = 0
            while not await request.is_disconnected():
                current = await asyncio.to_thread(services.fingerprint, registry)
                if current != last:
                    last = current
                    yield f"event: update\ndata: {current}\n\n"
                elif ticks % 15 == 0:
                    yield ": keep-alive\n\n"
                ticks += 1
                await asyncio.sleep(settings.poll_seconds)
        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=[View])
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(services.prometheus(registry), media_type="text/plain; version=0.0.4")

    # HTML pages --------------------------------------------------------------------------------
    def page(request: Request, name: str, **context: Any) -> HTMLResponse:
        response = TEMPLATES.TemplateResponse(request, name, {"admin_enabled": bool(settings.admin_token), **context})
        token = request.query_params.get("token")
        if settings.view_token and token:
            response.set_cookie("fedforge_view", token, httponly=True, samesite="strict")
        return response

    @app.get("/", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def overview_page(request: Request) -> HTMLResponse:
        ov = services.overview(registry, bool(settings.admin_token))
        detail = services.run_detail(registry, ov.current_run.id) if ov.current_run else None
        rounds = [r for r in detail.rounds if r.status == "completed"] if detail else []
        federated = services.federated_series(registry, ov.current_run.id) if ov.current_run else {"accuracy": []}
        chart_acc = charts.line_chart("Global accuracy per round", {"test set": [(r.server_round, r.accuracy) for r in rounds if r.accuracy is not None],
                                      "factories' held-out images": federated["accuracy"]}, "the model each round produced", y_max=1.0)
        chart_loss = charts.line_chart("Global loss per round", {"loss": [(r.server_round, r.loss) for r in rounds]}, "cross-entropy")
        per_factory = {"training accuracy (example-weighted mean)": [(r.server_round, r.metrics["factory-train-accuracy"]) for r in rounds
                                                                     if "factory-train-accuracy" in r.metrics]}
        chart_fac = charts.line_chart("Factories' local training", per_factory, "during the round", y_max=1.0)
        return page(request, "overview.html", ov=ov, run=detail, charts=[chart_acc, chart_loss, chart_fac], factories=services.factories(registry))

    @app.get("/runs", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def runs_page(request: Request, paging: Paging) -> HTMLResponse:
        runs = services.runs(registry, *paging)
        return page(request, "runs.html", runs=runs.items, pager=runs)

    @app.get("/runs/{run_id}", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def run_page(request: Request, run_id: RunId) -> HTMLResponse:
        detail = services.run_detail(registry, run_id)
        if detail is None:
            raise HTTPException(404, f"no run {run_id}")
        done = [r for r in detail.rounds if r.status == "completed"]
        central = {"test set": [(r.server_round, r.accuracy) for r in done if r.accuracy is not None]}
        federated = services.federated_series(registry, run_id)
        chart = charts.line_chart("Accuracy per round", {**central, "factories' held-out images": federated["accuracy"]},
                                  "the model each round produced", y_max=1.0)
        rates = charts.line_chart("Escape and false-reject rates per round", {"escape rate": federated["escape rate"],
                                  "false-reject rate": federated["false-reject rate"]}, "on the factories' held-out images", y_max=1.0)
        return page(request, "run.html", run=detail, chart=chart + rates)

    @app.get("/factories", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def factories_page(request: Request, paging: Paging) -> HTMLResponse:
        factories = services.paged(services.factories(registry), *paging)
        return page(request, "factories.html", factories=factories.items, pager=factories)

    @app.get("/privacy", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def privacy_page(request: Request, paging: Paging) -> HTMLResponse:
        pager = services.paged(services.privacy(registry), *paging)
        spend = pager.items
        limit = max((p.epsilon_max for p in spend if p.epsilon_max), default=None)
        chart = charts.line_chart("Privacy spent (epsilon) per factory", {p.factory: [(h.server_round, h.epsilon_spent) for h in p.history] for p in spend},
                                  "epsilon", reference=limit)
        return page(request, "privacy.html", spend=spend, chart=chart, pager=pager)

    @app.get("/versions", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def versions_page(request: Request, paging: Paging) -> HTMLResponse:
        versions = services.versions(registry, *paging)
        return page(request, "versions.html", versions=versions.items, pager=versions)

    @app.get("/versions/{version_id}", response_class=HTMLResponse, dependencies=[View], include_in_schema=False)
    def version_page(request: Request, version_id: VersionId) -> HTMLResponse:
        detail = services.version_detail(registry, version_id, public_key)
        if detail is None:
            raise HTTPException(404, f"no version {version_id}")
        latest = detail.evaluations[0] if detail.evaluations else None
        heat = charts.heatmap(f"Confusion matrix on {latest.examples} held-out images at {latest.factories} factories ({latest.phase} evaluation)",
                              latest.confusion, latest.classes) if latest else charts.heatmap("Confusion matrix", [], [])
        return page(request, "version.html", v=detail, heatmap=heat, latest=latest)

    return app


def serve_dashboard(settings: DashboardSettings, host: str, port: int) -> Any:
    """Run uvicorn in a background thread (used by ``fedforge server`` and ``fedforge demo``)."""
    import threading

    import uvicorn

    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True, name="fedforge-dashboard")
    thread.start()
    return server
