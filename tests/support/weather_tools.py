"""Two function tools defined as pydantic models, as an OpenAI SDK user defines them: the
tool-calling tests render, parse and serve these."""

from __future__ import annotations

from typing import Literal

import openai
from pydantic import BaseModel, Field

class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]

class GetTime(BaseModel):
    """The local time in a city."""

    city: str = Field(max_length=24)

WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")

TIME = openai.pydantic_function_tool(GetTime, name="get_time")
