"""An Orbax checkpoint handler for pytrees of sharded arrays in jaxtron's shard format (``shards.py``).

Orbax's ``CheckpointManager`` drives it: it creates the temporary step directory, calls ``async_save`` (whose
synchronous part is the blocking part of a save), runs the returned commit future in the background, waits
for every process, then renames the directory into place, so a step directory exists only once complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, List, Optional

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint._src import asyncio_utils

from jaxtron.checkpoint import shards


class ShardedArraysHandler(ocp.AsyncCheckpointHandler):
    async def async_save(self, directory: epath.Path, args: "ShardedSave") -> Optional[List[ocp_future.Future]]:
        pending = shards.start_save(args.tree, args.check_finite)

        async def commit():
            await asyncio.to_thread(pending.write, str(directory))

        return [ocp_future.CommitFutureAwaitingContractedSignals(commit(), name="jaxtron_shards_save")]

    def save(self, directory: epath.Path, args: "ShardedSave") -> None:
        async def run():
            for f in await self.async_save(directory, args) or []:
                f.result()
        asyncio_utils.run_sync(run())

    def restore(self, directory: epath.Path, args: "ShardedRestore") -> Any:
        return shards.restore_tree(str(directory), args.target)

    def metadata(self, directory: epath.Path) -> Any:
        return shards.describe(str(directory))

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(ShardedArraysHandler, for_save=True)
@dataclasses.dataclass
class ShardedSave(ocp.args.CheckpointArgs):
    tree: Any
    check_finite: bool = True  # refuse (NonFiniteStateError, before writing) a tree holding NaN or Inf


@ocp.args.register_with_handler(ShardedArraysHandler, for_restore=True)
@dataclasses.dataclass
class ShardedRestore(ocp.args.CheckpointArgs):
    target: Any  # pytree of jax.ShapeDtypeStruct with .sharding: the layout and dtype to restore into
