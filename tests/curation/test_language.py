"""The curation's language guess (the profile's language mix, ``data.balance: language``) on
the short requests agent and support traffic is made of."""

from __future__ import annotations

import pytest

from factory.language import language


@pytest.mark.parametrize(("text", "expected"), [
    ("Any update on my order #188130?", "en"),
    ("Good morning, Lukas here.", "en"),
    ("Où en est ma commande 642017 ?", "fr"),
    ("Bonsoir, je m'appelle Fatima.", "fr"),
    ("Annulez la commande #512503 : j'ai changé d'avis.", "fr"),
    ("¿Aceptan PayPal?", "es"),
    ("Buenos días, me llamo Chen.", "es"),
    ("Zahle ich Versand bei einer Bestellung von 107,90 €?", "de"),
    ("Guten Tag, mein Name ist Jonas.", "de"),
    ("Как дела?", "ru"),
])
def test_short_requests_get_their_language(text: str, expected: str) -> None:
    assert language(text) == expected


@pytest.mark.parametrize("text", ["", "Order 475441", "Visa", "la"])
def test_no_or_shared_function_words_stay_undetermined(text: str) -> None:
    # "la" is French, Spanish and Italian: one word two languages share decides nothing.
    assert language(text) == "und"
