"""MLX's CUDA kernel cache under MTPLX_HOME: the NVIDIA driver's /proc files are faked here
(this machine has no GPU); everything else is real (folders, the environment mapping)."""

from pathlib import Path

from mtplxd import kernel_cache


def _fake_driver(root: Path, model: str) -> Path:
    board = root / "0000:19:00.0"
    board.mkdir(parents=True)
    (board / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t 123\nGPU UUID: GPU-1\n")
    return root


def test_on_an_nvidia_machine_the_cache_goes_under_home_keyed_by_mlx_and_gpu(tmp_path):
    proc = _fake_driver(tmp_path / "proc", "NVIDIA H200")
    env: dict[str, str] = {}
    folder = kernel_cache.activate(env, home=tmp_path / "home", proc_root=proc)
    from importlib import metadata

    assert folder == tmp_path / "home" / "cache" / "ptx" / metadata.version("mlx") / "NVIDIA-H200"
    assert folder.is_dir() and env[kernel_cache.ENV] == str(folder)


def test_a_cache_folder_the_user_chose_is_kept(tmp_path):
    proc = _fake_driver(tmp_path / "proc", "NVIDIA H200")
    env = {kernel_cache.ENV: "/fast/ptx"}
    assert kernel_cache.activate(env, home=tmp_path / "home", proc_root=proc) is None
    assert env == {kernel_cache.ENV: "/fast/ptx"} and not (tmp_path / "home").exists()


def test_without_an_nvidia_driver_nothing_is_set(tmp_path):
    env: dict[str, str] = {}
    assert kernel_cache.activate(env, home=tmp_path / "home", proc_root=tmp_path / "no-driver") is None
    assert env == {} and not (tmp_path / "home").exists()
    assert kernel_cache.gpu_model(tmp_path / "no-driver") is None


def test_an_unwritable_home_leaves_mlx_its_default(tmp_path):
    proc = _fake_driver(tmp_path / "proc", "NVIDIA GeForce RTX 4090")
    blocker = tmp_path / "home"
    blocker.write_text("a file where the folder should be")
    env: dict[str, str] = {}
    assert kernel_cache.activate(env, home=blocker, proc_root=proc) is None and env == {}


def test_model_names_become_safe_folder_names():
    assert kernel_cache.cache_dir(Path("/h"), "NVIDIA GeForce RTX 4090/x", "0.32.4").name == "NVIDIA-GeForce-RTX-4090-x"
