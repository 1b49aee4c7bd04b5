"""What the tests share: reference models, trace builders, servers, runners."""
