# Two commands do all set-up on a fresh machine (they create .venv on first use: the library
# installed editable, and a .pth with the checkout's root, so that its models/ imports too;
# the wheel itself carries invact_jax and pallas_kernels only):
#   make train   # scripts/train_vit.py's default job
#   make test    # the test suite (what .ci/run runs)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: train test deviceless gpu-test gpu-report device-wheels clean
train: $(VENV)/.installed
	$(BIN)/python scripts/train_vit.py $(ARGS)

test: $(VENV)/.installed $(VENV)/deviceless/.installed-2
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder README.md docs invact_jax pallas_kernels models tests $(ARGS)

# The compilers for compiling for a GPU or TPU without one (invact_jax.targets,
# docs/deviceless.md): XLA:GPU's (the CUDA plugin at the venv's jaxlib version, ptxas, and
# cuDNN without the cuBLAS it lists: compiling needs none) and XLA:TPU's (libtpu at JAX's pin),
# in $(VENV)/deviceless, off JAX's start-up (which on a machine without the device would log
# tracebacks in every process); invact_jax loads them from there on the first compile for
# such a device.  libtpu goes in its own directory, deviceless/tpu, never on sys.path: its
# package sets TPU_LIBRARY_PATH as it is imported, and a process started after that (a
# training run's workers) takes itself for a TPU host.  About 1.1 GB of wheels, 2.3 GB installed.
DEVICELESS_WHEELS = nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cudnn-cu12==9.28.0.42
deviceless: $(VENV)/deviceless/.installed-2
$(VENV)/deviceless/.installed-2: $(VENV)/.installed
	rm -rf $(VENV)/deviceless
	v=$$($(BIN)/python -c "import jaxlib; print(jaxlib.__version__)"); \
	tpu=$$($(BIN)/python -c "from importlib.metadata import requires; \
	  print(next(r.split(';')[0].replace(' ', '') for r in requires('jax') if r.startswith('libtpu')))"); \
	  $(BIN)/python -m pip install -q --no-deps --target $(VENV)/deviceless \
	    jax-cuda12-plugin==$$v jax-cuda12-pjrt==$$v $(DEVICELESS_WHEELS) && \
	  $(BIN)/python -m pip install -q --no-deps --target $(VENV)/deviceless/tpu "$$tpu"
	touch $@

# On a GPU machine with JAX installed (no downloads needed): the tests that exercise the device
# (ops, memory, models; the compiled kernels run only there), then every GPU figure.
gpu-test:
	PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false $(PYTHON) -m pytest -m gpu -n 12 tests $(ARGS)

# Every GPU figure, ~8 minutes.
gpu-report:
	PYTHONPATH=. $(PYTHON) scripts/gpu_report.py $(ARGS)

# The wheels a GPU session carries in .whl (ignored; the GPU machine downloads nothing; see
# docs/gpu-report.md): liger-kernel, tokamax and what tokamax imports that the machine's image
# (Python 3.12) lacks.
DEVICE_WHEELS = liger-kernel==0.8.5 tokamax==0.0.17 einshape==1.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 qwix==0.1.8 immutabledict==4.3.1 tensorboardx==2.6.5 \
  xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 jax-triton==0.3.1
device-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(DEVICE_WHEELS)

# keras-hub (its backbones, for the conversion's tests) goes in without the TensorFlow its
# tokenizers need (pip extras cannot say --no-deps), at the versions keras-hub pins itself.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps keras-hub==0.32.0 kagglehub==1.0.3 kagglesdk==0.1.28
	$(BIN)/python -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'invact_jax_checkout.pth').write_text(str(pathlib.Path.cwd()) + '\n')"
	touch $@

clean:
	rm -rf $(VENV) runs
