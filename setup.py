"""Package metadata for the Pixal3D fork with built-in staging."""
from setuptools import find_packages, setup

setup(
    name="pixal3d-staged",
    version="0.1.0",
    description="Pixal3D image-to-3D (1024_cascade) with stage-aware model loading and memory telemetry",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=[*find_packages(include=["pixal3d", "pixal3d.*", "pipelines", "pipelines.*"]), "pixal3d.configs"],
    # The shipped configs: configs/ in the checkout, pixal3d/configs/ once installed (pixal3d.config.shipped_config).
    package_dir={"pixal3d.configs": "configs"},
    package_data={"pixal3d.configs": ["*.yaml"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "pillow",
        "safetensors",
        # 1.31: transformers 5's own floor; < 3: the majors tested (1.31 with httpx, 2.4 with httpx2: pixal3d.hub
        # finds the client's error base from HfHubHTTPError, tests/pixal3d/test_fetch_network.py runs on both)
        "huggingface_hub>=1.31,<3",
        "transformers>=4.56",  # DINOv3ViTModel first shipped in 4.56
        "rembg[cpu]",
        "trimesh",
        "xatlas==0.0.11",  # the keyword binding (normals/uvs) is pinned by tests/pixal3d/mesh/test_mesh_simplify_uv.py
        "fast-simplification>=0.2",  # preserve_border for the slab pre-pass
        "scipy",
        "psutil",
        "tqdm",
        "pyyaml",
        "matplotlib",
    ],
    extras_require={
        # wheel: tests/test_packaging.py builds one (setuptools < 70.1 needs it); the [serve] packages and httpx: the
        # job server's tests start it and talk to it over HTTP; psycopg: its queue on a real PostgreSQL server
        "test": ["pytest>=7", "wheel", "httpx>=0.27", "fastapi>=0.110", "uvicorn>=0.30", "python-multipart>=0.0.9",
                 "psycopg[binary]>=3.1,<4", "meshoptimizer==0.2.30a0"],
        # compressed GLBs (--compression meshopt): zeux/meshoptimizer's Python binding, pinned (its decoder's raw
        # mode is used with an opaque dtype per vertex: pixal3d/mesh/glb_container.py)
        "compress": ["meshoptimizer==0.2.30a0"],
        "dev": ["pytest>=7", "ruff"],
        # the web app (pixal3d-app); tested with 6.31
        "app": ["gradio>=6.31,<7"],
        # the job server (pixal3d-serve); tested with fastapi 0.165, uvicorn 0.54, python-multipart 0.0.34
        "serve": ["fastapi>=0.110", "uvicorn>=0.30", "python-multipart>=0.0.9"],
        # the job server's queue in PostgreSQL, shared by several machines (--queue postgresql://...); tested with
        # psycopg 3.3 and PostgreSQL 15
        "fleet": ["fastapi>=0.110", "uvicorn>=0.30", "python-multipart>=0.0.9", "psycopg[binary]>=3.1,<4"],
    },
    entry_points={
        "console_scripts": [
            "pixal3d-image-to-mesh=pipelines.cli:main",
            "pixal3d-guard=pixal3d.guard:main",
            "pixal3d-app=pipelines.app.main:main",
            "pixal3d-serve=pipelines.serve.main:main",
            "pixal3d-fetch=pixal3d.fetch:main",
        ],
    },
)
