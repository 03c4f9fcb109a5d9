# syntax=docker/dockerfile:1
# conveyor: an OpenAI-compatible LLM server. Two targets from one file:
#
#   cuda (default): torch + triton CUDA wheels from PyPI. They bundle the CUDA runtime (cuBLAS,
#       cuDNN, NCCL; triton its ptxas), so the image needs only the host's NVIDIA driver, which
#       the NVIDIA Container Toolkit mounts (`docker run --gpus all`).
#         docker build -t conveyor .
#         docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro conveyor \
#             --model /models/Qwen2.5-0.5B-Instruct
#   cpu: torch's CPU wheel, and no triton (the CPU path never imports it; only the CUDA
#       kernels need it): no CUDA libraries, a much smaller image. The build fails unless the
#       CPU C kernels build and load (`python -m conveyor.model.cpu.cpu_kernels`); they are built
#       for the build machine's CPU (-march=native) and rebuilt at first start on another one
#       (a second, under the user's cache). For a fleet of mixed CPUs pass
#       `--build-arg CONVEYOR_CPU_ISA=avx2` (or portable): that build runs on all of them.
#         docker build --target cpu -t conveyor:cpu .
#         docker run -p 8000:8000 conveyor:cpu            # serves the embedded demo model
#
# The server listens on port 8000 inside the container (map another host port with -p; the
# HEALTHCHECK polls 8000) and runs as the non-root user `conveyor` (uid 1000). Checkpoints are
# read from the /models volume. Arguments after the image name go to `conveyor serve`
# (--model, --config, --served-model-name, ...); the repository's configs/ are in
# /opt/conveyor/configs (the entrypoint's --host and --port win over a config file). Pass the
# API key as `-e CONVEYOR_API_KEY=...` to keep it out of the process list. `docker stop` sends
# SIGTERM: in-flight requests get --shutdown-timeout (10 s) to finish, so let docker wait
# longer: `docker stop -t 20`.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.7.1

# ---------------------------------------------------------------- shared base
FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/conveyor \
    CONVEYOR_CACHE_DIR=/home/conveyor/.cache/conveyor \
    HF_HOME=/home/conveyor/.cache/huggingface
# gcc: the CPU C kernels are compiled at first use, and triton compiles a small C launcher per
# kernel at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin conveyor

# ---------------------------------------------------------------- the conveyor wheel
FROM base AS wheel
WORKDIR /build
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- CPU image
FROM base AS cpu
ARG TORCH_VERSION
ARG CONVEYOR_CPU_ISA=
ENV CONVEYOR_CPU_ISA=${CONVEYOR_CPU_ISA}
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /wheels /wheels
# triton is a dependency for the CUDA kernels only (tests/project/test_packaging.py checks that
# the CPU path runs without it): hundreds of MB this image does not need.
RUN pip install /wheels/*.whl && rm -rf /wheels && pip uninstall -y triton
COPY configs /opt/conveyor/configs
USER conveyor
WORKDIR /home/conveyor
# The C kernels must build and load (else the image would serve the slow torch path); the
# demo checkpoint is built now, so a container without --model starts at once.
RUN python -m conveyor.model.cpu.cpu_kernels \
    && python -c "from conveyor.model.loading.demo import demo_model_path; print(demo_model_path())"
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["conveyor", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []

# ---------------------------------------------------------------- CUDA image (default)
FROM base AS cuda
ARG TORCH_VERSION
ARG TRITON_VERSION
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN pip install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels
COPY configs /opt/conveyor/configs
USER conveyor
WORKDIR /home/conveyor
RUN python -c "from conveyor.model.loading.demo import demo_model_path; print(demo_model_path())"
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["conveyor", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
