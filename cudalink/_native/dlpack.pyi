from typing_extensions import CapsuleType

class Exporter:
    def __init__(
        self,
        ptr: int,
        device_type: int,
        device_id: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        code: int,
        bits: int,
    ) -> None: ...
    def capsule(self, hold: object, readonly: bool, versioned: bool) -> CapsuleType: ...
