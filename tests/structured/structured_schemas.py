"""Pydantic models the structured-output tests ask the demo model for.

Strings and integers are bounded: the demo model's weights are random, so only the grammar
makes its output valid, and an unbounded string would run on until max_tokens.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

Short = Annotated[str, StringConstraints(max_length=10)]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: Short
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):  # nested objects
    person: Person
    address: Address


class Tagged(BaseModel):  # arrays
    tags: list[Short] = Field(max_length=3)
    scores: list[Annotated[int, Field(ge=0, le=9)]] = Field(max_length=4)


class Paint(BaseModel):  # enums
    color: Color
    finish: Literal["matte", "gloss"]


class Bounded(BaseModel):  # numbers with bounds
    rating: int = Field(ge=1, le=5)
    ratio: float = Field(ge=0.0, le=1.0)


class WithOptionals(BaseModel):  # optional fields (allowed under strict, as vLLM does)
    title: Short
    subtitle: Short | None = None
    pages: Annotated[int, Field(ge=1, le=999)] | None = None


class Codes(BaseModel):  # strings with patterns
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")
    day: str = Field(pattern=r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$")


class Flags(BaseModel):
    active: bool
    deleted: bool


class Item(BaseModel):
    name: Short
    quantity: int = Field(ge=0, le=100)


class Order(BaseModel):  # an array of objects
    id: int = Field(ge=1, le=9999)
    items: list[Item] = Field(min_length=1, max_length=3)


class Meeting(BaseModel):  # everything together
    kind: Literal["call", "visit"]
    attendees: list[Person] = Field(max_length=2)
    room: Short | None = None


SCHEMAS: list[type[BaseModel]] = [
    Person, Customer, Tagged, Paint, Bounded, WithOptionals, Codes, Flags, Order, Meeting,
    Address,
]  # fmt: skip


def slow_schema(tag: str) -> dict:
    """A schema that compiles in about a second; `tag` makes each one a new constraint."""
    objects = {
        f"o{j}": {"type": "object", "properties": {f"{tag}{i}": {"type": "string"}
                                                   for i in range(250)}}
        for j in range(7)
    }  # fmt: skip
    return {"type": "object", "properties": objects}
