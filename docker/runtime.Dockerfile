# The runtime only: serves bundles, compiles nothing. No Triton, no transformers, no nvcc in the image: a
# bundle brings its kernels (cubins for the archs it was built for), and engc loads them through the CUDA
# driver the host provides (the NVIDIA container toolkit mounts it).
#
#   docker build -f docker/runtime.Dockerfile -t engc-runtime .
#   docker run --gpus all -p 23333:23333 -v $PWD/bundles/my-model:/bundle:ro engc-runtime
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ cmake ninja-build && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# torch from its CUDA 12.8 wheels: the runtime's tensors and cuBLAS; engc itself without the compiler extras
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cu128 \
 && pip wheel --no-deps -w /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cu128 \
 && pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && python -c "import importlib.util as u, sys; bad = [m for m in ('triton', 'transformers') if u.find_spec(m)]; sys.exit(f'compiler packages in the runtime image: {bad}' if bad else 0)"
EXPOSE 23333
ENTRYPOINT ["engc", "run", "/bundle", "--host", "0.0.0.0", "--port", "23333"]
