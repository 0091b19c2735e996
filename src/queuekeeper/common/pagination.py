"""Waldur-style pagination: a bare JSON array, with `Link` and `X-Result-Count` headers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Query, Request, Response
from pydantic import BaseModel
from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

T = TypeVar("T")


class Page(BaseModel):
    page: int
    page_size: int

    @property
    def offset(self) -> int:
        return (self.page - 1) * self.page_size


# Bounds keep every offset within the databases' 64-bit integers (a page number past them
# used to reach the database and fail there): 2**31 pages of 1000 is 2**41 rows.
MAX_PAGE = 2**31
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True)
class Paged(Generic[T]):
    """One page of a list, and how many items the whole list has."""

    total: int
    rows: list[T]


def page_params(
    page: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page number, from 1.")] = 1,
    page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="Items per page.")] = 100,
) -> Page:
    return Page(page=page, page_size=page_size)


def set_page_headers(request: Request, response: Response, page: Page, total: int) -> None:
    response.headers["X-Result-Count"] = str(total)
    links = []
    if page.offset + page.page_size < total:
        links.append(f'<{request.url.include_query_params(page=page.page + 1)}>; rel="next"')
    if page.page > 1:
        links.append(f'<{request.url.include_query_params(page=page.page - 1)}>; rel="prev"')
    if links:
        response.headers["Link"] = ", ".join(links)


def set_bounded_page_headers(
    request: Request, response: Response, page: Page, total: int, *, capped: bool, more: bool
) -> None:
    """`set_page_headers` for a list counted only up to a bound (`total` is then the bound
    and `capped` true, said by `X-Result-Count-Capped`): `next` follows whether a row
    follows this page (`more`), not the count."""
    set_page_headers(request, response, page, total)
    if capped:
        response.headers["X-Result-Count-Capped"] = "true"
    links = []
    if more:
        links.append(f'<{request.url.include_query_params(page=page.page + 1)}>; rel="next"')
    if page.page > 1:
        links.append(f'<{request.url.include_query_params(page=page.page - 1)}>; rel="prev"')
    if links:
        response.headers["Link"] = ", ".join(links)
    elif "Link" in response.headers:
        del response.headers["Link"]


async def fetch_page(
    session: AsyncSession, query: Select[T], *order_by: Any, offset: int, limit: int
) -> tuple[int, list[T]]:
    """The total matching `query`, and one page of it in the given order."""
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = await session.scalars(query.order_by(*order_by).offset(offset).limit(limit))
    return int(total), list(rows)


async def fetch_paged(
    session: AsyncSession, query: Select[T], *order_by: Any, page: Page
) -> Paged[T]:
    """`fetch_page` for one page of the API's `page`/`page_size` parameters."""
    total, rows = await fetch_page(
        session, query, *order_by, offset=page.offset, limit=page.page_size
    )
    return Paged(total, rows)
