"""The README's model table is the one tests/model_table.py generates from the registry and the tests."""
from engine.models import MODEL_REGISTRY
from tests.model_table import README, TESTED_CONFIGS, architecture, in_readme, render


def test_readme_model_table_is_generated():
    assert in_readme(README.read_text()) == render(), "run: python -m tests.model_table --write"


def test_every_registered_architecture_is_tested_token_exact():
    tested = {architecture(make().model_type) for make in TESTED_CONFIGS.values()}
    # Mistral: LlamaForCausalLM's code, tested as mistral-window; Gemma 4's multimodal checkpoints: its text model,
    # tested in tests/engine/test_gemma4.py.
    assert set(MODEL_REGISTRY) - tested <= {"MistralForCausalLM", "Gemma4ForConditionalGeneration"}


def test_the_image_architectures_are_the_vision_families():
    from engine.models import FAMILIES
    from engine.multimodal.config import IMAGE_ARCHITECTURES

    assert IMAGE_ARCHITECTURES == {arch for family in FAMILIES if family.vision for arch in family.classes}
