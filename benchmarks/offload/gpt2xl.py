from minidl.zoo.transformers import TransformerConfig, gpt


def gpt2_xl():
    """GPT-2 XL: 48 layers, 25 heads, 1600 wide, context 1024, 50257 tokens (1.56 B parameters)."""
    return gpt(TransformerConfig(48, 25, 1600, 1024, 50257, dropout=0.1, gelu="tanh"),
               name="gpt2-xl")
