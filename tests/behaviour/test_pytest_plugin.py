"""gsync's pytest plugin (gsync_pytest), as a user's pytest-asyncio suite sees it: run with pytester."""

from __future__ import annotations

import re
import tomllib
from typing import Any

import pytest
from tests.support.models import TiedNet, classification_loss, make_batches, sgd
from tests.support.paths import ROOT

import gsync

pytest_plugins = ("pytester",)


INI = """
[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
filterwarnings = error
gsync_leak_grace = 0.3
"""

# A user's training code, as the tests below import it.
TRAINING = '''
import torch
import torch.nn.functional as F


def model_and_data(steps=6, rows=16):
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    data = [(torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,), generator=generator)) for _ in range(steps)]
    return model, data


async def train(engine, steps=6, resume=None):
    model, data = model_and_data(steps)
    return await engine.fit(
        model,
        data,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        resume=resume,
    )
'''


@pytest.fixture(scope="module", autouse=True)
def _imports_done_outside_pytester() -> None:
    """Run one fit before any pytester run, so what a fit imports lazily is imported for good.

    pytester removes the modules an in-process run imported when it ends; torch cannot import some of them twice
    (``torch._dynamo``, imported by the first optimizer step, registers operator libraries).
    """
    import asyncio

    import torch

    import gsync

    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(4, 4), torch.randint(0, 2, (4,)))]
    asyncio.run(
        gsync.Engine(["cpu:0", "cpu:1"]).fit(
            model,
            data,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
        )
    )


@pytest.fixture
def user_project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    pytester.makepyfile(my_project=TRAINING)
    pytester.syspathinsert()
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # `-p gsync_pytest` as well as the entry point: the same name, so it loads once either way.
    return pytester.runpytest("-p", "gsync_pytest", "-p", "no:cacheprovider", *args)


@pytest.mark.timeout(60)
def test_fixtures_give_engines_on_virtual_cpu_devices(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(
        test_user='''
        import pytest
        from my_project import train


        @pytest.mark.asyncio
        async def test_trains_on_two_devices_by_default(gsync_engine):
            assert [d.name for d in gsync_engine.devices] == ["cpu:0", "cpu:1"]
            result = await train(gsync_engine)
            assert len(result.losses) == 6


        @pytest.mark.gsync_engine(devices=3, sync_timeout=7.0)
        def test_marker_sets_devices_and_engine_settings(gsync_engine):
            assert len(gsync_engine.devices) == 3 and gsync_engine.sync_timeout == 7.0


        @pytest.mark.parametrize("gsync_engine", [1, {"devices": ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]}], indirect=True)
        def test_indirect_parametrization(gsync_engine):
            assert len(gsync_engine.devices) in (1, 4)


        def test_factory_builds_more_engines(gsync_engine_factory):
            assert len(gsync_engine_factory(5).devices) == 5
            assert gsync_engine_factory(["cpu:0"], on_nonfinite="skip").on_nonfinite == "skip"
        '''
    )
    result = run(user_project)
    result.assert_outcomes(passed=5)


@pytest.mark.timeout(60)
def test_fault_fixture_makes_training_raise_worker_failed_for_the_step(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(
        test_user='''
        import gsync
        import pytest
        import pytest_asyncio
        import torch
        from my_project import model_and_data, train


        @pytest.mark.asyncio
        async def test_failure_names_device_and_step_and_resumes(gsync_engine, gsync_faults):
            fault = gsync_faults.fail(device=1, step=3, site="backward")
            with pytest.raises(gsync.WorkerFailed) as caught:
                await train(gsync_engine)
            assert (caught.value.device_index, caught.value.step, caught.value.site) == (1, 3, "backward")
            assert caught.value.last_step == 2 and fault.reached.is_set()
            resumed = await train(gsync_engine, resume=caught.value.checkpoint)  # each fault fires once
            assert resumed.first_step == 3 and len(resumed.losses) == 3


        @pytest.mark.asyncio
        async def test_faults_on_an_engine_of_your_own(gsync_engine_factory, gsync_faults):
            engine = gsync_engine_factory(3)
            gsync_faults.fail(device=2, step=0, site="forward", error=ValueError("bad shard"), engine=engine)
            with pytest.raises(gsync.WorkerFailed) as caught:
                await train(engine)
            assert caught.value.device == "cpu:2" and isinstance(caught.value.__cause__, ValueError)
            assert caught.value.last_step is None


        @pytest.mark.asyncio
        async def test_faults_are_disarmed_after_the_test_that_armed_them(gsync_engine):
            from tests.support.inside import site_hooks_of

            assert site_hooks_of(gsync_engine) == []


        @pytest_asyncio.fixture
        async def session(gsync_engine):
            model, _ = model_and_data()
            async with gsync_engine.session(
                model,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
            ) as session:
                yield session


        @pytest.mark.asyncio
        async def test_a_fault_armed_after_a_fixture_opened_the_session_fires(session, gsync_faults):
            _, data = model_and_data()
            gsync_faults.fail(device=1, step=1, site="backward")
            await session.step(data[0])
            with pytest.raises(gsync.WorkerFailed) as caught:
                await session.step(data[1])
            assert (caught.value.device_index, caught.value.step) == (1, 1)


        @pytest.mark.asyncio
        @pytest.mark.gsync_engine(sync_timeout=0.3)
        async def test_a_stall_armed_after_a_fixture_opened_the_session_stalls_it(session, gsync_faults):
            _, data = model_and_data()
            fault = gsync_faults.stall(device=0, step=0, site="forward")
            with pytest.raises(gsync.SyncTimeout):
                await session.step(data[0])
            assert fault.reached.is_set()
        '''
    )
    result = run(user_project)
    result.assert_outcomes(passed=5)


@pytest.mark.timeout(60)
def test_a_test_that_leaves_a_gsync_thread_running_fails_naming_it(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(
        test_user='''
        import asyncio
        import gsync
        import pytest
        from my_project import train


        @pytest.mark.asyncio
        @pytest.mark.gsync_engine(sync_timeout=1.0, device_threads="shared")
        async def test_leaves_a_stuck_device(gsync_engine, gsync_faults):
            # Native code that ignores cancellation: the thread stays stuck until released, which this test forgets.
            gsync_faults.stall(device=1, step=1, site="forward", interruptible=False)
            with pytest.raises(gsync.SyncTimeout):
                await train(gsync_engine)


        @pytest.mark.gsync_engine(sync_timeout=1.0, device_threads="per_device")
        def test_a_sync_test_leaves_a_stuck_device(gsync_engine, gsync_faults):
            gsync_faults.stall(device=0, step=2, site="backward", interruptible=False)
            with pytest.raises(gsync.SyncTimeout):
                asyncio.run(train(gsync_engine))


        @pytest.mark.asyncio
        @pytest.mark.gsync_engine(sync_timeout=1.0)
        async def test_releases_the_stall_in_time(gsync_engine, gsync_faults):
            fault = gsync_faults.stall(device=1, step=1, site="forward", interruptible=False)
            with pytest.raises(gsync.SyncTimeout):
                await train(gsync_engine)
            fault.release.set()


        @pytest.mark.asyncio
        @pytest.mark.gsync_allow_leaks
        @pytest.mark.gsync_engine(sync_timeout=1.0)
        async def test_opted_out(gsync_engine, gsync_faults):
            gsync_faults.stall(device=1, step=1, site="forward", interruptible=False)
            with pytest.raises(gsync.SyncTimeout):
                await train(gsync_engine)
        '''
    )
    result = run(user_project)
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_user.py::test_leaves_a_stuck_device left gsync running (0.3 s after it returned):",
            "*thread 'gsync-devices'",  # the thread this process's CPU devices share
            "*Await every fit and session the test starts*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*test_a_sync_test_leaves_a_stuck_device left gsync running*", "*thread 'gsync-device-0'"]  # the stalled one
    )
    failed = {line.split(" - ")[0] for line in result.stdout.lines if line.startswith("FAILED")}
    assert failed == {
        "FAILED test_user.py::test_leaves_a_stuck_device",
        "FAILED test_user.py::test_a_sync_test_leaves_a_stuck_device",
    }


@pytest.mark.timeout(60)
def test_a_test_that_leaves_a_fit_task_running_fails_naming_it(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(
        test_user='''
        import asyncio
        import pytest
        from my_project import train


        @pytest.mark.asyncio
        async def test_forgets_to_await_its_fit(gsync_engine):
            asyncio.get_running_loop().create_task(train(gsync_engine, steps=2_000), name="forgotten fit")


        @pytest.mark.asyncio
        async def test_cancels_and_awaits_its_fit(gsync_engine):
            task = asyncio.get_running_loop().create_task(train(gsync_engine, steps=2_000))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        '''
    )
    result = run(user_project)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_forgets_to_await_its_fit left gsync running*", "*task 'forgotten fit' in Engine.fit (gsync/engine.py:*)"]
    )
    assert "test_cancels_and_awaits_its_fit left gsync running" not in result.stdout.str()


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Testing your training code\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README's testing section has no python example"
    return match.group(1)


@pytest.mark.timeout(60)
def test_the_readme_example_passes(user_project: pytest.Pytester) -> None:
    example = _readme_example()
    assert len(example.strip().splitlines()) <= 12, example
    user_project.makepyfile(test_readme=example)
    result = run(user_project)
    result.assert_outcomes(passed=1)


def test_the_plugin_is_a_pytest11_entry_point_and_the_testing_extra_has_its_runners() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["entry-points"]["pytest11"] == {"gsync_pytest": "gsync_pytest"}
    testing = project["optional-dependencies"]["testing"]
    assert {re.split(r"[<>=\[ ]", requirement)[0] for requirement in testing} == {"pytest", "pytest-asyncio", "pytest-timeout"}
    assert any(requirement.startswith("gsync[") and "testing" in requirement for requirement in project["optional-dependencies"]["dev"])


def test_loading_the_plugin_imports_neither_torch_nor_gsync(pytester: pytest.Pytester) -> None:
    """A suite that does not use gsync pays nothing for the plugin but a check that finds nothing."""
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_plain():
            assert "torch" not in sys.modules and "gsync" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "gsync_pytest", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.gsync_engine(devices=3)
async def test_this_suite_uses_the_fixtures_too(gsync_engine: gsync.Engine, gsync_faults: Any) -> None:
    fault = gsync_faults.fail(device=2, step=1, site="backward")
    with pytest.raises(gsync.WorkerFailed) as caught:
        await gsync_engine.fit(TiedNet(), make_batches(4, rows=12), optimizer=sgd, loss_fn=classification_loss)
    assert (caught.value.device_index, caught.value.step, caught.value.site) == (2, 1, "backward")
    assert fault.reached.is_set() and caught.value.last_step == 0


@pytest.mark.timeout(90)
def test_sessions_held_by_fixtures_in_both_shapes_and_scopes_pass_the_leak_check(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(
        test_fixtures='''
        import pytest
        import pytest_asyncio
        import torch
        import torch.nn.functional as F

        import gsync
        from my_project import model_and_data

        RECIPE = dict(
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        )


        @pytest_asyncio.fixture
        async def scoped_session(gsync_engine):
            model, _ = model_and_data()
            async with gsync_engine.session(model, **RECIPE) as session:
                yield session


        @pytest_asyncio.fixture
        async def held_session(gsync_engine):
            model, _ = model_and_data()
            session = await gsync_engine.session(model, **RECIPE)
            yield session
            await session.aclose()


        @pytest_asyncio.fixture(loop_scope="module", scope="module")
        async def module_session():
            model, _ = model_and_data()
            session = await gsync.Engine(["cpu:0", "cpu:1"]).session(model, **RECIPE)
            yield session
            await session.aclose()


        @pytest.mark.asyncio
        async def test_steps_scoped(scoped_session):
            _, data = model_and_data()
            result = await scoped_session.step(data[0])
            assert result.step == 0 and result.loss > 0


        @pytest.mark.asyncio
        async def test_steps_held(held_session):
            _, data = model_and_data()
            assert (await held_session.step(data[0])).step == 0


        @pytest.mark.asyncio
        async def test_fits(held_session):
            _, data = model_and_data()
            result = await held_session.fit(data, progress=False)
            assert [record.step for record in result.history] == list(range(6))


        @pytest.mark.asyncio(loop_scope="module")
        async def test_module_first(module_session):
            _, data = model_and_data()
            assert (await module_session.step(data[0])).step == 0


        @pytest.mark.asyncio(loop_scope="module")
        async def test_module_goes_on(module_session):
            _, data = model_and_data()
            assert (await module_session.step(data[1])).step == 1  # the same session, one step further
            assert (await module_session.evaluate(data))["loss"] > 0
        '''
    )
    result = run(user_project)
    result.assert_outcomes(passed=5)
    assert "left gsync running" not in result.stdout.str()
