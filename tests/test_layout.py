"""The Layout: sizes resolved once, the batch and pipeline arithmetic, the checks that need the mesh sizes."""

import jax
import pytest

from helpers import TINY, tiny_config
from jaxtron import config as config_lib
from jaxtron import preflight
from jaxtron.config import ConfigError
from jaxtron.parallel.axes import AXES
from jaxtron.parallel.layout import Layout


def test_fills_the_minus_one_axis_and_derives_the_batch_arithmetic():
    cfg = tiny_config("parallel.data=-1", "parallel.tensor=2", "train.global_batch_size=16",
                      "train.micro_batch_size=2")
    layout = Layout.build(cfg, jax.devices())
    assert dict(layout.sizes) == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1,
                                    "tensor": 2}
    assert (layout.dp, layout.tp, layout.stages, layout.num_devices) == (4, 2, 1, 8)
    assert layout.accumulation_steps == 2 and layout.bubble == 0.0
    assert layout.mesh.axis_names == AXES and layout.mesh.devices.shape == layout.shape == (1, 4, 1, 1, 1, 2)
    assert layout.describe() == "data=4 fsdp=1 tensor=2 stage=1"


@pytest.mark.parametrize("schedule,virtual,expected", [("1f1b", 1, 3 / (4 + 3)), ("gpipe", 1, 3 / (4 + 3)),
                                                       ("circular", 2, 3 / (2 * 4 + 3))])
def test_pipeline_bubble(schedule, virtual, expected):
    cfg = tiny_config("model.num_layers=8", "parallel.stage=4", "parallel.data=2",
                      f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={virtual}",
                      "train.global_batch_size=8", "train.micro_batch_size=1")
    layout = Layout.planned(cfg, 8)
    assert layout.accumulation_steps == 4
    assert layout.bubble == pytest.approx(expected)
    assert layout.pipeline().micro_batches == 4
    assert layout.pipeline(for_eval=True).schedule == ("gpipe" if schedule == "1f1b" else schedule)


@pytest.mark.parametrize("overrides,field", [
    (("parallel.data=-1", "parallel.tensor=3"), "parallel.data"),         # 8 devices do not divide by 3
    (("parallel.data=2", "parallel.tensor=2"), "parallel"),               # 4 != 8 devices
    (("parallel.data=-1", "parallel.fsdp=8", "train.global_batch_size=4"), "train.global_batch_size"),
    (("parallel.data=-1", "parallel.stage=8", "model.num_layers=4"), "model.num_layers"),
    (("parallel.data=1", "parallel.fsdp=-1", "parallel.stage=2", "parallel.pipeline_schedule=circular",
      "model.num_layers=4", "train.global_batch_size=8", "train.micro_batch_size=2"), "train.micro_batch_size"),
])
def test_mesh_dependent_errors_name_the_field(overrides, field):
    """Checks that need the resolved sizes (a -1 axis is known only once the device count is); the config is
    loaded unvalidated so that the Layout's own check is the one that fires."""
    cfg = config_lib.load(None, TINY + list(overrides), validate_config=False)
    with pytest.raises(ConfigError) as err:
        Layout.planned(cfg, 8)
    assert str(err.value).startswith(f"{field}:"), str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_fixed_sizes_are_checked_before_the_devices_are_known():
    with pytest.raises(ConfigError, match=r"^parallel.tensor: model.num_heads=8 is not divisible by tensor=3"):
        preflight.check(tiny_config("parallel.tensor=3"))


def test_collective_axes_for_the_planner():
    layout = Layout.planned(tiny_config("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"), 8)
    # logical ids are positions in the (stage, data, fsdp, expert, context, tensor) = (1, 2, 2, 1, 1, 2) mesh
    assert layout.axes_of_group([0, 1]) == ("tensor",)
    assert layout.axes_of_group([0, 2]) == ("fsdp",)
    assert layout.axes_of_group([0, 2, 4, 6]) == ("data", "fsdp")
    assert layout.axes_of_pairs([(0, 4), (4, 0)]) == ("data",)
    assert layout.on_critical_path(("tensor",)) and not layout.on_critical_path(("data", "fsdp"))
    with pytest.raises(ValueError, match="planned without devices"):
        layout.sharding(("act_batch", None))
