"""Design campaigns: the design space, the campaign folder, the round function that picks each batch (the
predictor and the batch rule), the proposals' files and the picture. Imports every layer below it; nothing
but the commands and the API imports it."""
