"""What the app holds for its lifetime, and the FastAPI dependencies that hand it out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.config import Settings


@dataclass
class AppState:
    settings: Settings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    management: ManagementClient
    provisioner: Provisioner
    # Started in the lifespan by the layers that own them (publishing, jobs); None
    # until started, and in tests that do not need them.
    publisher: Any = None
    relay: Any = None
    scheduler: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


async def get_state(request: Request) -> AppState:
    # async, so FastAPI calls it in the event loop instead of a worker thread per request
    state: AppState = request.app.state.queuekeeper
    return state


async def get_session(
    state: Annotated[AppState, Depends(get_state)],
) -> AsyncIterator[AsyncSession]:
    async with state.sessions() as session:
        yield session


StateDep = Annotated[AppState, Depends(get_state)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]
