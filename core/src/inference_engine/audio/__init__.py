"""Audio input for speech models: decoding uploads, Whisper log-mel features, the feature pool."""
