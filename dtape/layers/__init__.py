"""Keras-style layers built on dtape ops, one module per family as Keras's `layers/`.

Each layer is a `Module`; its variables are made with `dtape.Variable` when it
is built (on the first call, by `build(input_shape)`, or at construction from
`input_shape=` or a size argument), so a strategy's `scope()` turns them into
distributed variables (see `dtape.layers.base`).

Source: tf.keras.layers.
"""
from dtape.layers.base import (Constant, GlorotUniform, HeNormal, HeUniform, Initializer, Layer, Ones, RandomNormal,
                               RandomUniform, TruncatedNormal, Zeros, get_activation, get_initializer)
from dtape.layers.activations import Activation, LeakyReLU, ReLU, Softmax
from dtape.layers.attention import MultiHeadAttention
from dtape.layers.convolutional import Conv1D, Conv2D, Conv2DTranspose
from dtape.layers.core import Dense, Lambda, Masking, Rescaling
from dtape.layers.embedding import Embedding
from dtape.layers.merging import Add, Concatenate, Multiply, add, concatenate, multiply
from dtape.layers.normalization import BatchNormalization, LayerNormalization
from dtape.layers.pooling import (AveragePooling2D, GlobalAveragePooling1D, GlobalAveragePooling2D, GlobalMaxPooling1D,
                                  GlobalMaxPooling2D, MaxPooling2D)
from dtape.layers.regularization import Dropout
from dtape.layers.reshaping import Flatten, Permute, Reshape, UpSampling2D, ZeroPadding2D
from dtape.layers.sequential import Sequential
from dtape.torch_module import TorchModule

__all__ = ["Lambda", "Rescaling", "Softmax", "ZeroPadding2D", "Layer", "Dense", "Conv2D", "Embedding", "LayerNormalization", "BatchNormalization", "Dropout",
           "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D", "GlobalMaxPooling2D", "Flatten", "Reshape",
           "Sequential", "Activation", "get_activation", "get_initializer",
           "Conv1D", "Conv2DTranspose", "ReLU", "LeakyReLU", "Add", "Multiply", "Concatenate", "Permute",
           "UpSampling2D", "GlobalAveragePooling1D", "GlobalMaxPooling1D", "MultiHeadAttention", "Masking",
           "add", "concatenate", "multiply"]
