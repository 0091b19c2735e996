"""What the app holds for its lifetime, and the FastAPI dependencies that hand it out.

Endpoints ask for the collaborators they pass to a service (`SessionDep`,
`SettingsDep`, `ProvisionerDep`, ...), never for the whole state: a service's
signature says what it uses. This module holds only what endpoints depend on; what the
process runs besides (the job runner, the intake, the relay, the scheduler, readiness's
memory) is the composition root's (`app.Runtime`), so nothing here imports a domain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from queuekeeper.broker.management import ManagementClient
from queuekeeper.broker.provisioner import Provisioner
from queuekeeper.common.signals import OutboxSignals
from queuekeeper.config import Settings


@dataclass(kw_only=True)
class AppState:
    settings: Settings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    management: ManagementClient
    provisioner: Provisioner
    # Shared by the accept path, the relay and `?wait=true` waiters of this process.
    signals: OutboxSignals = field(default_factory=OutboxSignals)


async def get_state(request: Request) -> AppState:
    # async, so FastAPI calls it in the event loop instead of a worker thread per request
    state: AppState = request.app.state.queuekeeper
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def get_session(state: StateDep) -> AsyncIterator[AsyncSession]:
    async with state.sessions() as session:
        yield session


async def get_engine(state: StateDep) -> AsyncEngine:
    return state.engine


async def get_sessions(state: StateDep) -> async_sessionmaker[AsyncSession]:
    return state.sessions


async def get_settings(state: StateDep) -> Settings:
    return state.settings


async def get_provisioner(state: StateDep) -> Provisioner:
    return state.provisioner


async def get_management(state: StateDep) -> ManagementClient:
    return state.management


async def get_signals(state: StateDep) -> OutboxSignals:
    return state.signals


SessionDep = Annotated[AsyncSession, Depends(get_session)]
# For what runs on no session: `db.read_one`, and a Core connection's transaction.
EngineDep = Annotated[AsyncEngine, Depends(get_engine)]
SessionsDep = Annotated[async_sessionmaker[AsyncSession], Depends(get_sessions)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ProvisionerDep = Annotated[Provisioner, Depends(get_provisioner)]
ManagementDep = Annotated[ManagementClient, Depends(get_management)]
SignalsDep = Annotated[OutboxSignals, Depends(get_signals)]
