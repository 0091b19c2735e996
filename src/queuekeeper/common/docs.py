"""`/docs` (Swagger UI) and `/redoc` served with their assets from this installation.

FastAPI's own pages load Swagger UI and ReDoc from a public CDN, which a site without
internet access cannot reach: the page stays blank. The assets come from the
`fastapi-offline` package (maintained, versioned with the rest of the dependencies) and
are served under `/docs-assets/`. A Content-Security-Policy keeps both pages to this
server: ReDoc's bundle would otherwise still fetch its attribution logo from its CDN.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"
ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSET_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")

# Everything from this server; inline the pages' own start-up script and the styles their
# bundles inject; ReDoc's search runs in a worker made from a blob.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self' 'unsafe-inline'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self' data:",
        "worker-src 'self' blob:",
        "connect-src 'self'",
        "frame-ancestors 'self'",
    ]
)

SWAGGER_UI_PARAMETERS = {
    "dom_id": "#swagger-ui",
    "layout": "BaseLayout",
    "deepLinking": True,
    "showExtensions": True,
    "showCommonExtensions": True,
    # No "valid" badge: it would send the document to validator.swagger.io.
    "validatorUrl": None,
}


def install_docs(app: FastAPI) -> None:
    """Mount the assets and add `/docs` and `/redoc`; create the app with
    `docs_url=None, redoc_url=None` so FastAPI's CDN pages are not added too."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    def prefix(request: Request) -> str:
        root: str = request.scope.get("root_path", "")
        return root.rstrip("/")

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> JSONResponse:
        """Someone opened the service's address: say where to go."""
        base = prefix(request)
        return JSONResponse(
            {
                "service": app.title,
                "detail": f"The API is described at {base}/docs (and {base}/redoc); "
                "README.md, Quickstart, shows the first calls.",
                "docs": f"{base}/docs",
                "openapi": f"{base}/openapi.json",
                "health": f"{base}/healthz",
                "ready": f"{base}/readyz",
            }
        )

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        base = prefix(request)
        page = get_swagger_ui_html(
            openapi_url=f"{base}/openapi.json",
            title=f"{app.title} - API",
            swagger_js_url=f"{base}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{base}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{base}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
        )
        page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return page

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        base = prefix(request)
        page = get_redoc_html(
            openapi_url=f"{base}/openapi.json",
            title=f"{app.title} - API reference",
            redoc_js_url=f"{base}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{base}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
        page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return page
