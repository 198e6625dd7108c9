"""The Responses API (`/v1/responses`) over the chat path, and its stored responses."""
