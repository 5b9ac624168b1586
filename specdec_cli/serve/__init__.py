"""`specdec serve`: OpenAI request checking, the HTTP server, the web page."""
