"""The decoding core: who drafts (drafters, translation across vocabularies), how much
(draft length and tree policies, priced by the measured costs), who verifies (sampling),
and the one decode loop that runs every slot."""
