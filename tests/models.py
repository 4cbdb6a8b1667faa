"""Compact ResNet-18/50 and MobileNetV2 structurally equal to torchvision's (same modules, names, shapes and forward),
for tests and benchmarks on machines without torchvision."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------- ResNet
def conv3x3(cin: int, cout: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=dilation, groups=groups, bias=False, dilation=dilation)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: the stride sits on the 3x3 conv, as in torchvision."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


# ---------------------------------------------------------------------------------------------- MobileNetV2
def _make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 activation_layer: Optional[Callable[..., nn.Module]] = nn.ReLU6) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)
        self.out_channels = cout


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, kernel_size=1))
        layers += [
            Conv2dNormActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2) -> None:
        super().__init__()
        input_channel, last_channel = 32, 1280
        settings = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2],
                    [6, 320, 1, 1]]
        input_channel = _make_divisible(input_channel * width_mult)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult))
        features: list[nn.Module] = [Conv2dNormActivation(3, input_channel, stride=2)]
        for t, c, n, s in settings:
            output_channel = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000) -> MobileNetV2:
    return MobileNetV2(num_classes)


# ---------------------------------------------------------------------------------------------- ConvNeXt-T
class LayerNorm2d(nn.LayerNorm):
    """torchvision's LayerNorm2d: LayerNorm over the channels of an NCHW tensor, through a permute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            _Permute([0, 2, 3, 1]), nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 4 * dim), nn.GELU(),
            nn.Linear(4 * dim, dim), _Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_scale * self.block(x) + x  # stochastic depth 0 (torchvision's default is 0.1 at train)


class _Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class ConvNeXt(nn.Module):
    """torchvision's ConvNeXt (convnext_tiny: depths 3-3-9-3, widths 96-768), same modules' shapes and forward;
    a 4x4 stride-4 stem with bias, 7x7 depthwise convs with bias, 2x2 stride-2 downsampling convs."""

    def __init__(self, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4, bias=True),
                                                 LayerNorm2d(dims[0], eps=1e-6))]
        for i, (depth, dim) in enumerate(zip(depths, dims)):
            layers.append(nn.Sequential(*[CNBlock(dim) for _ in range(depth)]))
            if i + 1 < len(dims):
                layers.append(nn.Sequential(LayerNorm2d(dim, eps=1e-6),
                                            nn.Conv2d(dim, dims[i + 1], kernel_size=2, stride=2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(dims[-1], eps=1e-6), nn.Flatten(1),
                                        nn.Linear(dims[-1], num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def convnext_tiny(num_classes: int = 1000) -> ConvNeXt:
    return ConvNeXt(num_classes=num_classes)


# ---------------------------------------------------------------------------------------------- EfficientNet-B0
class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: 1x1 convs with bias on the pooled 1x1 image, a gate scaling the input."""

    def __init__(self, cin: int, squeeze: int, activation: Callable[..., nn.Module] = nn.ReLU,
                 scale_activation: Callable[..., nn.Module] = nn.Sigmoid) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(cin, squeeze, 1), nn.Conv2d(squeeze, cin, 1)
        self.activation, self.scale_activation = activation(), scale_activation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))


class MBConv(nn.Module):
    def __init__(self, expand_ratio: int, kernel: int, stride: int, cin: int, cout: int) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = _make_divisible(cin * expand_ratio, 8)
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, kernel_size=1, activation_layer=nn.SiLU))
        layers += [Conv2dNormActivation(expanded, expanded, kernel_size=kernel, stride=stride, groups=expanded,
                                        activation_layer=nn.SiLU),
                   SqueezeExcitation(expanded, max(1, cin // 4), activation=nn.SiLU),
                   Conv2dNormActivation(expanded, cout, kernel_size=1, activation_layer=None)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + x if self.use_res_connect else self.block(x)  # stochastic depth 0 (torchvision: 0.2)


class EfficientNet(nn.Module):
    """torchvision's efficientnet_b0 (same modules' shapes and forward; stochastic depth and dropout left out): a 3x3
    stride-2 stem, MBConv blocks with 3x3 / 5x5 depthwise convs, SiLU and squeeze-excitation, a 1x1 head to 1280."""

    SETTINGS = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
                (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [Conv2dNormActivation(3, 32, kernel_size=3, stride=2, activation_layer=nn.SiLU)]
        for expand, kernel, stride, cin, cout, n in self.SETTINGS:
            layers.append(nn.Sequential(*[MBConv(expand, kernel, stride if i == 0 else 1, cin if i == 0 else cout,
                                                 cout) for i in range(n)]))
        layers.append(Conv2dNormActivation(320, 1280, kernel_size=1, activation_layer=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_b0(num_classes: int = 1000) -> EfficientNet:
    return EfficientNet(num_classes)


MODELS = {"resnet18": resnet18, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2, "convnext_tiny": convnext_tiny,
          "efficientnet_b0": efficientnet_b0}


def model_from_spec(spec: str) -> nn.Module:
    """The model `cutlass-byoc tune --model SPEC` traces, built under seed 0: one of MODELS by name (torchvision's
    twins, without torchvision), else `offload.trace.load_model`'s ``torchvision:NAME``, ``timm:NAME`` or
    ``package.module:factory``."""
    torch.manual_seed(0)
    if spec in MODELS:
        return MODELS[spec]()
    from cutlass_byoc.offload.trace import load_model  # noqa: PLC0415

    return load_model(spec)


def conv_counts(model: nn.Module) -> dict[str, int]:
    """How many Conv2d modules a model has: all, depthwise (groups == C == K) and grouped non-depthwise."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    dw = [m for m in convs if m.groups > 1 and m.groups == m.in_channels == m.out_channels]
    return {"all": len(convs), "depthwise": len(dw), "dense": len(convs) - len(dw)}


# ---------------------------------------------------------------------------------------------- families the partitioner
# must never break (conv+bias+ReLU chains, UNet, grouped, dilated): CPU tests and GPU tests share them
class Chain(nn.Module):
    """VGG-style conv + bias + ReLU chains (fire-module-like 1x1/3x3 mix), optionally pooled between convs."""

    def __init__(self, pool: bool):
        super().__init__()
        self.pool = pool
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.c3 = nn.Conv2d(16, 32, 1)
        self.c4 = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.c1(x))
        y = F.relu(self.c2(y))
        if self.pool:
            y = F.max_pool2d(y, 2)
        y = F.relu(self.c3(y))
        if self.pool:
            y = F.avg_pool2d(y, 2)
        return F.relu(self.c4(y))


class UNet(nn.Module):
    """A small UNet: encoder blocks, pooling, a transposed-conv decoder with channel concat, a 1x1 head of 2
    classes."""

    def __init__(self):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1),
                                 nn.ReLU())

        self.e1, self.e2, self.mid = block(3, 16), block(16, 32), block(32, 64)
        self.up2, self.d2 = nn.ConvTranspose2d(64, 32, 2, stride=2), block(64, 32)
        self.up1, self.d1 = nn.ConvTranspose2d(32, 16, 2, stride=2), block(32, 16)
        self.head = nn.Conv2d(16, 2, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.d2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.d1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 16, 3, padding=1)
        self.g = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.c2 = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        return self.c2(F.relu(self.g(F.relu(self.c1(x)))))


class Dilated(nn.Module):
    """DeepLab-style dilated convs at stride 1 (dilation 2 and 3) and one at stride 2."""

    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(8, 16, 3, padding=1)
        self.d2 = nn.Conv2d(16, 16, 3, padding=2, dilation=2)
        self.d3 = nn.Conv2d(16, 24, 3, padding=3, dilation=3)
        self.s2 = nn.Conv2d(24, 24, 3, stride=2, padding=2, dilation=2)

    def forward(self, x):
        y = F.relu(self.c0(x))
        y = F.relu(self.d2(y))
        y = F.relu(self.d3(y))
        return self.s2(y)


class ConvNeXtLike(nn.Module):
    """ConvNeXt's pieces: a 4x4 stride-4 patchify stem with bias, LayerNorm2d, 7x7 depthwise blocks with bias whose
    pointwise layers are Linear in NHWC, a 2x2 stride-2 downsampling conv."""

    in_channels = 3

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 4, stride=4), LayerNorm2d(32))
        self.b1 = CNBlock(32, layer_scale=0.5)  # ConvNeXt-T's block, its branch scaled up to matter
        self.down = nn.Sequential(LayerNorm2d(32), nn.Conv2d(32, 64, 2, stride=2))
        self.b2 = CNBlock(64, layer_scale=0.5)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.b2(self.down(self.b1(self.stem(x)))).mean((2, 3)))


class ResNeXtBlock(nn.Module):
    """A ResNeXt bottleneck: 1x1, 3x3 with 8 groups (left to PyTorch), 1x1, residual."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(16, 64, 1, bias=False), nn.BatchNorm2d(64)
        self.c2, self.b2 = nn.Conv2d(64, 64, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(64)
        self.c3, self.b3 = nn.Conv2d(64, 16, 1, bias=False), nn.BatchNorm2d(16)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        return F.relu(x + self.b3(self.c3(y)))


class MobileNetV3Block(nn.Module):
    """MobileNetV3's block: 1x1 expansion, 5x5 stride-2 depthwise, hardswish, SE with hardsigmoid, 1x1 projection;
    a 1x1 head with bias."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.exp, self.bn1 = nn.Conv2d(16, 48, 1, bias=False), nn.BatchNorm2d(48)
        self.dw, self.bn2 = nn.Conv2d(48, 48, 5, stride=2, padding=2, groups=48, bias=False), nn.BatchNorm2d(48)
        self.se = SqueezeExcitation(48, 12, scale_activation=nn.Hardsigmoid)
        self.proj, self.bn3 = nn.Conv2d(48, 24, 1, bias=False), nn.BatchNorm2d(24)
        self.head = nn.Conv2d(24, 10, 1)

    def forward(self, x):
        y = F.hardswish(self.bn1(self.exp(x)))
        y = self.se(F.hardswish(self.bn2(self.dw(y))))
        return self.head(self.bn3(self.proj(y)))


class InceptionLike(nn.Module):
    """Inception's asymmetric 1x7 / 7x1 convs, a pooled 1x1 branch and a channel concat."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(16, 16, 1)
        self.b1, self.b2 = nn.Conv2d(16, 16, (1, 7), padding=(0, 3)), nn.Conv2d(16, 24, (7, 1), padding=(3, 0))
        self.p = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return torch.cat([F.relu(self.a(x)), F.relu(self.b2(F.relu(self.b1(x)))),
                          F.relu(self.p(F.avg_pool2d(x, 3, 1, 1)))], 1)


class ASPP(nn.Module):
    """DeepLab's atrous spatial pyramid pooling: dilated 3x3 branches, a 1x1 conv on the pooled image upsampled
    bilinearly, a 1x1 fuse."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([nn.Conv2d(16, 16, 1, bias=False)] +
                                      [nn.Conv2d(16, 16, 3, padding=d, dilation=d, bias=False) for d in (2, 3)])
        self.pool = nn.Conv2d(16, 16, 1)
        self.fuse = nn.Conv2d(64, 16, 1)

    def forward(self, x):
        g = F.interpolate(self.pool(x.mean((2, 3), keepdim=True)), size=x.shape[-2:], mode="bilinear",
                          align_corners=False)
        return self.fuse(torch.cat([F.relu(b(x)) for b in self.branches] + [g], 1))


class Multiplier(nn.Module):
    """Depthwise with channel multiplier 2 (groups == C, K == 2C) and a 2-group conv, both left to PyTorch, then a
    plain depthwise conv; SiLU between."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(16, 32, 3, padding=1, groups=16)
        self.b = nn.Conv2d(32, 32, 3, padding=1, groups=2)
        self.c = nn.Conv2d(32, 32, 3, padding=1, groups=32)

    def forward(self, x):
        return self.c(F.silu(self.b(F.silu(self.a(x)))))


class Paddings(nn.Module):
    """Reflect and circular padding modes, padding="same" with an even kernel (asymmetric), a 1x3 kernel at stride
    3."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.r = nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect")
        self.c = nn.Conv2d(16, 16, 3, padding=1, padding_mode="circular")
        self.s = nn.Conv2d(16, 16, 4, padding="same")
        self.v = nn.Conv2d(16, 16, (1, 3), stride=3)

    def forward(self, x):
        return self.v(self.s(self.c(self.r(x))))


class SharedFrozen(nn.Module):
    """One conv applied twice (its weight gradient sums two passes), a frozen conv (no weight gradient), and a conv
    whose pre-activation output is used twice (the activation must not be fused)."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(16, 16, 3, padding=1)
        self.frozen = nn.Conv2d(16, 16, 1)
        self.frozen.requires_grad_(False)
        self.d = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.c(F.relu(self.c(x))))
        z = self.d(self.frozen(y))
        return F.relu(z) + 0.5 * z


class Slices(nn.Module):
    """Convs over views: a channel slice at an offset, a strided spatial slice, an offset spatial slice."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)
        self.c = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = self.a(x[:, 3:11])
        z = self.b(y[..., ::2, ::2])
        return self.c(z[:, :, 1:, 1:]).mean((2, 3)) + y.mean((2, 3))[:, :8]


class WeightStandardized(nn.Module):
    """A conv whose weight is computed in the graph (weight standardization, as BiT and NFNets), GroupNorm, SiLU."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16, 3, 3) * 0.1)
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x):
        w = (self.w - self.w.mean((1, 2, 3), keepdim=True)) / (self.w.std((1, 2, 3), keepdim=True) + 1e-5)
        return F.silu(self.norm(F.conv2d(x, w, padding=1)))


class DenseLike(nn.Module):
    """DenseNet layers: BN-ReLU-1x1-BN-ReLU-3x3, each output concatenated to its input."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()
        c = 16
        for _ in range(3):
            self.layers.append(nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, 32, 1, bias=False),
                                             nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 8, 3, padding=1, bias=False)))
            c += 8

    def forward(self, x):
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return x


class RegNetLike(nn.Module):
    """RegNetY's block: 1x1, a strided 3x3 of group width 8 (left to PyTorch), SE, 1x1, a strided 1x1 shortcut."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=4, bias=False), nn.BatchNorm2d(32)
        self.se = SqueezeExcitation(32, 8)
        self.c3, self.b3 = nn.Conv2d(32, 32, 1, bias=False), nn.BatchNorm2d(32)
        self.short = nn.Conv2d(16, 32, 1, stride=2, bias=False)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.se(F.relu(self.b2(self.c2(y))))
        return F.relu(self.b3(self.c3(y)) + self.short(x))


class OddChannels(nn.Module):
    """Odd channel counts: a 1-channel image (a slice of the input), 10 and 7 channels, 33 outputs; leaky ReLU and
    tanh (not fused)."""

    in_channels = 3

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 10, 5, stride=2, padding=2)
        self.b = nn.Conv2d(10, 7, 3)
        self.c = nn.Conv2d(7, 33, 3, stride=2, padding=1, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(F.leaky_relu(self.a(x[:, :1])))))


class PositionalConv(nn.Module):
    """CPVT's positional encoding generator (y + dwconv(y), the depthwise conv with a bias: bias and residual in one
    depthwise epilogue, the bias-vector kernels) between 1x1 convs, then PVTv2's depthwise conv with a bias and GELU."""

    in_channels = 16

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(16, 32, 1)
        self.peg = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.out = nn.Conv2d(32, 16, 1)

    def forward(self, x):
        y = self.inp(x)
        y = y + self.peg(y)
        return self.out(F.gelu(self.dw(y)))


FAMILIES = {"chain": lambda: Chain(False), "chain_pool": lambda: Chain(True), "unet": UNet, "grouped": Grouped,
            "dilated": Dilated, "convnext": ConvNeXtLike, "resnext": ResNeXtBlock, "mobilenet_v3": MobileNetV3Block,
            "inception": InceptionLike, "aspp": ASPP, "multiplier": Multiplier, "paddings": Paddings,
            "shared_frozen": SharedFrozen, "slices": Slices, "weight_std": WeightStandardized, "dense": DenseLike,
            "regnet": RegNetLike, "odd_channels": OddChannels, "positional": PositionalConv}
#: tests/test_gpu_dynamic.py: families trained through torch.compile's default over these batch sizes (64x64): the
#: graph turns dynamic at the second size (its plan's batch), which then serves the rest (each size met again runs
#: on the C++ path's binding of that size)
DYNAMIC_FAMILIES = ("chain", "convnext", "dense", "mobilenet_v3", "paddings", "resnext")
DYNAMIC_BATCHES = (8, 5, 8, 3, 5, 8)


def input_channels(model: nn.Module) -> int:
    """The channels of the image a family (or model) takes: its `in_channels`, else its first conv's."""
    c = getattr(model, "in_channels", None)
    return c if isinstance(c, int) else next(m for m in model.modules() if isinstance(m, nn.Conv2d)).in_channels

