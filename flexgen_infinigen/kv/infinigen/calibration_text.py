"""The built-in calibration text for InfiniGen's skew, written for this project.

About 2,000 tokens in several registers (encyclopedic, narrative, dialogue, news, technical
instructions, lists and numbers), so that the query statistics it yields are not those of one
paragraph of one style. A real corpus (``--calibration FILE``) of the text you will run is
still better; the accuracy sweep in ``benchmarks/`` measures both.
"""

SECTIONS = [
    # encyclopedic
    "The Varnholt Canal is a navigable waterway in the north of the country, running for "
    "ninety-four kilometres between the river port of Aldmere and the coastal town of "
    "Sellick. Construction began in 1781 under the direction of the engineer Tobias Renne, "
    "who had studied lock design in the Low Countries, and the first barges passed through "
    "in 1793. The canal rises by sixty-one metres over twenty-three locks, most of them "
    "clustered in the Harrow Flight near its midpoint. During the nineteenth century it "
    "carried coal, grain, limestone and timber, and at its peak in 1846 more than 400,000 "
    "tonnes of cargo moved along it each year. The arrival of the railway in 1859 began a "
    "long decline. Commercial traffic ended in 1962, and the western section was drained "
    "and partly built over. A restoration trust founded in 1978 reopened the eastern half "
    "to leisure boats in 2004; today it is used by walkers, anglers and cyclists, and the "
    "old toll house at Fenwick Bridge is a small museum.",
    # science
    "Photosynthesis converts light energy into chemical energy stored in sugars. In plants it "
    "takes place in chloroplasts, organelles whose internal membranes hold the pigment "
    "chlorophyll. The process has two stages. In the light-dependent reactions, absorbed "
    "photons drive the splitting of water, releasing oxygen and producing the energy carriers "
    "ATP and NADPH. In the Calvin cycle, which does not need light directly, the enzyme "
    "rubisco fixes carbon dioxide from the air, and the ATP and NADPH are spent to build "
    "three-carbon sugars. Rubisco is slow and sometimes binds oxygen instead of carbon "
    "dioxide, a wasteful side reaction called photorespiration. Some plants, such as maize "
    "and sugar cane, concentrate carbon dioxide around the enzyme and so lose less energy "
    "in hot, dry conditions.",
    # narrative
    "Nadia had not meant to stay so late. By the time she locked the workshop the street "
    "lamps were already on, and the rain that had threatened all afternoon was falling in "
    "earnest. She pulled her collar up and walked quickly past the bakery, the closed "
    "bookshop and the laundrette with its single flickering sign. At the corner she stopped. "
    "Someone was sitting on the steps of the old chapel, a small figure wrapped in a coat "
    "far too large for him. \"Are you all right?\" she asked. The boy looked up, surprised, "
    "and nodded without conviction. \"I'm waiting for my uncle,\" he said. \"He said six "
    "o'clock.\" It was nearly nine. Nadia hesitated, then sat down beside him on the wet "
    "stone. \"Then we'll wait together,\" she said, \"and if he doesn't come, we'll find a "
    "telephone.\"",
    # news
    "City council members voted seven to two on Tuesday to approve a revised budget that "
    "increases spending on road repairs by 12 percent while delaying the planned expansion "
    "of the central library. Supporters said the decision reflected residents' complaints "
    "about potholes, which rose sharply after the unusually cold winter. Opponents argued "
    "that the library project had already been postponed twice and that construction costs "
    "would only grow. The mayor, speaking after the meeting, promised to revisit the library "
    "plans in the autumn once tax receipts for the first half of the year are known. The "
    "budget also includes funding for two additional bus routes and a pilot programme of "
    "free swimming lessons for children under ten.",
    # technical instructions
    "To replace the filter, first switch off the unit at the wall and wait at least five "
    "minutes for the fan to stop. Open the front panel by pressing the two catches on its "
    "upper edge. Slide the old filter out toward you, keeping it level so that trapped dust "
    "does not fall into the housing. Check the arrow printed on the frame of the new filter: "
    "it must point toward the back of the unit, in the direction of the airflow. Insert the "
    "new filter fully, close the panel until both catches click, and restore power. If the "
    "warning light continues to blink, hold the reset button for three seconds. Filters "
    "should be replaced every six months, or every three months in dusty environments.",
    # lists and numbers
    "Results of the regional athletics meeting. Men's 1500 metres: 1. K. Osei, 3:41.8; 2. "
    "P. Lindqvist, 3:42.3; 3. M. Duarte, 3:44.0. Women's long jump: 1. A. Novak, 6.52 m; 2. "
    "R. Taylor, 6.31 m; 3. J. Mbeki, 6.28 m. Mixed relay, 4 x 400 metres: 1. Eastfield "
    "Harriers, 3:24.16; 2. Northgate, 3:26.90; 3. Riverside Athletic, 3:27.45. Attendance "
    "was estimated at 2,300, the highest since 2016. The next meeting will be held on 14 "
    "June at the university stadium, with entries closing on 30 May.",
    # history and biography
    "Margarethe Voss was born in 1852 in a village on the edge of the Black Forest, the "
    "fourth of seven children of a clockmaker. Although girls were not admitted to the local "
    "grammar school, she was taught mathematics at home by her father and later by the "
    "village priest, who recognised her talent. In 1874 she moved to Zurich, one of the few "
    "universities in Europe then open to women, where she studied astronomy. Her careful "
    "measurements of variable stars, published between 1881 and 1899, were used by later "
    "astronomers to estimate distances within the galaxy. She never held a professorship, "
    "but her correspondence with leading scientists of the period fills eleven volumes.",
    # dialogue and argument
    "\"You can't be serious,\" said the older man. \"Nobody will pay for a bridge there.\" "
    "\"They already do,\" his daughter replied, spreading the map across the table. \"Look at "
    "the ferry records. Three thousand crossings a week, and the queue in summer is over an "
    "hour. Every farmer on the east bank loses half a day each time he takes his produce to "
    "market.\" He studied the map for a long time. \"And the cost?\" \"Less than the ferry "
    "company earns in fifteen years,\" she said. \"I've checked the figures twice.\" He "
    "folded his arms. \"Then check them a third time, and we'll talk to the council.\"",
    # geography and economics
    "The valley's economy has changed more in the last forty years than in the two centuries "
    "before. Small dairy farms, once the main source of income, have largely merged into a "
    "few large operations, and many of the old stone barns now serve as holiday cottages. "
    "Tourism brings visitors from April to October, drawn by the lakes, the mountain trails "
    "and the annual cheese festival, but the winter months are quiet and several shops close "
    "until spring. Younger residents often leave for the cities to study or work, although "
    "improved internet connections have allowed some to return and work remotely. Local "
    "officials hope that a new rail link, due to open in three years, will make the region "
    "easier to reach and encourage small businesses to settle there.",
    # explanation of a concept
    "A hash table stores values under keys so that each can be found quickly. It keeps an "
    "array of slots and a function that turns any key into a slot number. To insert a pair, "
    "the key is hashed and the value placed in that slot; to look it up, the key is hashed "
    "again and the slot read. Two different keys may hash to the same slot, which is called "
    "a collision. One common remedy keeps a short list in every slot; another probes the "
    "following slots until a free one is found. When the table becomes too full, lookups "
    "slow down, so the array is enlarged, usually doubled, and every entry is inserted again. "
    "With a good hash function, insertion and lookup take constant time on average.",
]

TEXT = "\n\n".join(SECTIONS) + "\n"
