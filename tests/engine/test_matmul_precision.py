"""Float32 matmuls stay float32: the engine asks MLX for it before MLX multiplies anything,
and leaves a choice the user made alone. Real environment mappings and a real process."""

import os
import subprocess
import sys

from mtplxd import matmul_precision


def test_tf32_is_turned_off_unless_the_user_chose():
    env: dict[str, str] = {}
    assert matmul_precision.activate(env) is True and env == {matmul_precision.ENV: "0"}
    for chosen in ("1", "0"):
        env = {matmul_precision.ENV: chosen}
        assert matmul_precision.activate(env) is False and env == {matmul_precision.ENV: chosen}


def test_what_status_says_float32_matmuls_run_in():
    assert matmul_precision.path_name(on_gpu=True, environ={matmul_precision.ENV: "0"}) == "float32"
    assert matmul_precision.path_name(on_gpu=True, environ={matmul_precision.ENV: "1"}).startswith("tf32")
    assert matmul_precision.path_name(on_gpu=True, environ={}).startswith("tf32")  # MLX's default
    assert matmul_precision.path_name(on_gpu=False, environ={matmul_precision.ENV: "1"}) == "float32"


def test_importing_the_engine_turns_it_off():
    env = {key: value for key, value in os.environ.items() if key != matmul_precision.ENV}
    code = ("import os, sys; import mtplxd.engine; "
            "print(os.environ.get('MLX_ENABLE_TF32'), 'mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["0", "True"]


def test_the_model_reports_it(tiny_qwen3):
    assert tiny_qwen3.info.kernels["float32_matmul"] == "float32"
